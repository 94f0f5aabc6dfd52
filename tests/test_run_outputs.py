"""What a run leaves behind and how it is read back: the run folder and runs/latest, config.yaml that replays
the run, the final HF model (AutoModelForCausalLM, AutoTokenizer, pipeline), --save-hf / --keep-last-n,
samples.jsonl, the live display and its plain fallback, the summary, `slime-core runs` / `plot`, and typed
YAML values."""

from __future__ import annotations

import datetime
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from slimecore.config import Config, ConfigError, Option, parse_config
from slimecore.display import RunDisplay
from slimecore.runs import config_yaml, create_run_dir, resolve_run

BASE = ["--prompt-data", "x.jsonl", "--rollout-batch-size", "4"]
ALGO = {"algo": [Option("eps_clip", float, 0.2), Option("mode", str, "a", choices=("a", "b"))]}


# -- typed YAML (before Ray starts) --------------------------------------------------------------------------


def test_yaml_values_are_converted_and_checked_like_the_flags(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("lr: 1e-5\nrollout_batch_size: '8'\nrollout_stop: </s>\nuse_lora: true\n"
                    "apply_chat_template_kwargs: {enable_thinking: false}\nalgo:\n  eps_clip: 1\n  mode: b\n")
    config = parse_config(["--prompt-data", "x.jsonl", "--config", str(good)], ["algo"], ALGO)
    assert config.lr == 1e-5 and isinstance(config.lr, float)  # YAML alone reads 1e-5 as a string
    assert config.rollout_batch_size == 8 and config.rollout_stop == ["</s>"] and config.use_lora is True
    assert config.apply_chat_template_kwargs == {"enable_thinking": False}
    assert config.plugin("algo").eps_clip == 1.0 and isinstance(config.plugin("algo").eps_clip, float)

    cases = [("lr: four", "line 2: lr: expected a number (as --lr takes), got 'four'"),
             ("rollout_batch_size: 2.5", "line 2: rollout_batch_size: expected an integer"),
             ("lr_decay_style: cosin", "lr_decay_style: expected one of constant, linear, cosine"),
             ("use_lora: 'yes'", "use_lora: expected true or false"),
             ("seed: [1, 2]", "seed: expected an integer"),
             ("lora_target_modules: {q: 1}", "lora_target_modules: expected a list of strings"),
             ("algo:\n  mode: c", "line 3: algo.mode: expected one of a, b (as --mode takes), got 'c'"),
             ("lr: null", "lr: expected a number")]
    for text, message in cases:
        bad = tmp_path / "bad.yaml"
        bad.write_text("seed: 3\n" + text + "\n")
        with pytest.raises(ConfigError) as err:
            parse_config(BASE + ["--config", str(bad)], ["algo"], ALGO)
        assert str(err.value).startswith(str(bad)) and message in str(err.value), str(err.value)


def test_a_bad_yaml_value_fails_in_the_cli_before_ray_starts(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("plugin: [grpo]\nrollout_batch_size: 2\nlr: four\n")
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{bad} line 3: lr: expected a number (as --lr takes), got 'four'" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr and not (tmp_path / "runs").exists()


# -- config.yaml replays the run ------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    ["--lr", "3e-5", "--eps-clip", "0.3", "--sglang-mem-fraction-static", "0.7", "--rollout-stop", "a", "b"],
    ["--num-steps-per-rollout", "2", "--mode", "b", "--use-lora", "--log-dir", "somewhere"],
])
def test_config_yaml_holds_the_resolved_config_and_parses_back_to_it(tmp_path, extra):
    config = parse_config(["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", *extra], ["algo"], ALGO)
    assert config.recommended_applied  # the built-in task's quick-start values were resolved in
    (tmp_path / "config.yaml").write_text(config_yaml(config))
    replay = parse_config(["--config", str(tmp_path / "config.yaml")], ["algo"], ALGO)
    expected = config.to_dict()
    expected["values"]["log_dir"] = None  # a replay gets a folder of its own
    assert replay.to_dict() == expected


def test_config_yaml_paths_are_absolute_so_a_replay_works_from_any_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    config = parse_config(["--prompt-data", "data/p.jsonl@[0:2]", "--rollout-batch-size", "1", "--save", "ckpt",
                           "--eval-prompt-data", "held", "data/p.jsonl", "cmp", "task:compare"], [], {})
    (tmp_path / "config.yaml").write_text(config_yaml(config))
    monkeypatch.chdir(tmp_path / "data")  # replayed from another folder
    replay = parse_config(["--config", str(tmp_path / "config.yaml")], [], {})
    assert replay.prompt_data == f"{tmp_path}/data/p.jsonl@[0:2]" and replay.save == str(tmp_path / "ckpt")
    assert replay.eval_prompt_data == ["held", str(tmp_path / "data" / "p.jsonl"), "cmp", "task:compare"]


# -- the run folder ------------------------------------------------------------------------------------------


def test_a_run_is_timed_and_dated_from_the_start_of_its_command(tmp_path):
    import time

    from slimecore.runs import COMMAND, run_info

    before = time.time()  # the command spends 1.5 s (imports, a model's conversion) before its run folder exists
    subprocess.run([sys.executable, "-c", "import sys, time; time.sleep(1.5); from slimecore.runs import "
                    "record_command; record_command(sys.argv[1])", str(tmp_path)], check=True, timeout=60)
    command = json.loads((tmp_path / COMMAND).read_text())
    assert before - 1 < command["started"] < before + 1 and command["argv"][0] == "-c"
    (tmp_path / "config.yaml").write_text("plugin: [grpo]\n")  # written later than the command started
    command["started"] = datetime.datetime(2026, 11, 28, 9, 0, 30).timestamp()
    (tmp_path / COMMAND).write_text(json.dumps(command))
    assert run_info(tmp_path)["started"] == "2026-11-28 09:00"


def test_the_run_folder_links_the_ray_session_logs_the_console_leaves_out(tmp_path):
    from slimecore.runs import RAY_LOGS, link_ray_logs

    logs = [tmp_path / "session_a" / "logs", tmp_path / "session_b" / "logs"]
    for folder in logs:
        folder.mkdir(parents=True)
    (logs[1] / "worker-1.err").write_text("Loading weights: 100%\n")
    link_ray_logs(tmp_path, str(logs[0]))
    link_ray_logs(tmp_path, str(logs[1]))  # a replay into the same folder points it at its own session
    assert (tmp_path / RAY_LOGS / "worker-1.err").read_text() == "Loading weights: 100%\n"


def test_run_folders_never_collide_and_latest_moves_atomically(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 25, 4, 30, 0)

    monkeypatch.setattr("slimecore.runs.datetime.datetime", Frozen)
    root = tmp_path / "runs"
    root.mkdir()
    (root / "latest").mkdir()  # what older versions wrote every run into
    (root / "latest" / "metrics.jsonl").write_text("{}\n")
    made = [create_run_dir(Config.make(plugins=["grpo", "./my_reward.py"]), root) for _ in range(3)]
    assert [p.name for p in made] == ["20261125-043000-grpo+my_reward", "20261125-043000-grpo+my_reward-2",
                                      "20261125-043000-grpo+my_reward-3"]
    assert (root / "latest").is_symlink() and (root / "latest").resolve() == made[-1].resolve()
    assert (root / "latest-before-20261125-043000" / "metrics.jsonl").is_file()  # kept, not overwritten
    given = Config.make(log_dir=str(tmp_path / "mine"))
    assert create_run_dir(given, root) == tmp_path / "mine" and given.log_dir == str(tmp_path / "mine")
    assert (root / "latest").resolve() == made[-1].resolve()  # --log-dir leaves runs/latest alone


# -- the display ---------------------------------------------------------------------------------------------


STEP = {"rollout/raw_reward": 0.25, "rollout/response_length": 12.5, "perf/step_time": 2.0, "train/loss": 0.1}


def test_live_display_shows_stage_progress_eta_and_last_step():
    out = io.StringIO()
    display = RunDisplay(Console(file=out, force_terminal=True, width=160), total=4, live=True)
    with display:
        display.stage("generate", 0)
        display.step(0, 4, STEP)
        display.stage("train", 1)
        display.progress.refresh()
        text = out.getvalue()
    assert "step 2: training" in text and "1/4" in text and "ETA 06s" in text  # 3 steps left at 2 s each
    assert "reward 0.25" in text and "len 12.5" in text and "step 2.0s" in text
    assert "\x1b[" in text  # drawn with terminal control codes


def test_plain_lines_when_not_a_terminal_and_log_levels():
    out = io.StringIO()
    display = RunDisplay(Console(file=out, width=200), total=4, level="debug")
    assert not display.live  # a StringIO is no terminal
    with display:
        display.stage("generate", 0)
        display.step(0, 4, STEP)
    lines = out.getvalue().splitlines()
    assert lines == ["starting engines and trainers (Ray, the router, the model on every process)",
                     "step 1: generating",
                     "step 1/4 reward=0.25  len=12.5  loss=0.1  step 2.0s  ETA 06s"]
    info = io.StringIO()  # at info: the start-up's and the first step's waits are said, later steps' stages not
    with RunDisplay(Console(file=info, width=200), total=4) as display:
        for rollout_id in (0, 1):
            display.stage("generate", rollout_id)
            display.stage("train", rollout_id)
            display.step(rollout_id, 4, STEP)
        display.stage("export", 4)
    assert [line for line in info.getvalue().splitlines() if not line.startswith("step 1/4") and
            not line.startswith("step 2/4")] == ["starting engines and trainers (Ray, the router, the model on every "
                                                 "process)", "step 1: generating", "step 1: training",
                                                 "writing the final model"]
    quiet = io.StringIO()
    with RunDisplay(Console(file=quiet), total=4, level="warning") as display:
        display.stage("generate", 0)
        display.step(0, 4, STEP)
    assert quiet.getvalue() == ""


# -- a real run, and reading it back ---------------------------------------------------------------------------


def _cli(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "COLUMNS": "200"})  # tables unabridged
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def finished_run(tiny_checkpoint, tmp_path_factory):
    """One tiny GRPO run from a clean working directory, with no --log-dir, as a user starts one."""
    pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
    cwd = tmp_path_factory.mktemp("work")
    proc = _cli(cwd, "train", "--plugin", "grpo", "--hf-checkpoint", str(tiny_checkpoint), "--rollout-batch-size",
                "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
                "--num-rollout", "3", "--apply-chat-template", "--no-use-tensorboard", "--log-samples", "3",
                "--save", "ckpt", "--save-interval", "1", "--save-hf", "--keep-last-n", "2",
                "--plugin", str(Path(__file__).with_name("digits_reward_plugin.py")))  # dense: the weights move
    return cwd, proc


def test_a_run_leaves_a_folder_with_everything_in_it(finished_run, tiny_checkpoint):
    cwd, proc = finished_run
    [run] = [p for p in (cwd / "runs").iterdir() if not p.is_symlink()]
    assert run.name.endswith("-grpo+digits_reward_plugin") and (cwd / "runs" / "latest").resolve() == run.resolve()
    for name in ("config.yaml", "command.json", "metrics.jsonl", "samples.jsonl", "summary.json", "curves.png",
                 "final"):
        assert (run / name).exists(), name
    assert (run / "ray-logs").is_symlink() and any((run / "ray-logs").glob("worker-*"))  # the actors' output
    # the console: plain step lines (stdout/stderr are pipes here), then the summary with the paths
    lines = proc.stderr.splitlines()
    steps = [line for line in lines if line.startswith("step ") and "/" in line.split()[1]]
    assert len(steps) == 3 and steps[-1].startswith("step 3/3 reward=") and not any("\x1b[" in s for s in steps)
    # each wait longer than a few seconds is said as it starts: Ray, the engines and trainers, the first rollout
    for said in ("starting a local Ray instance", "starting engines and trainers", "step 1: generating"):
        assert any(said in line for line in lines), said
    assert "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr  # the actors' bars
    assert "reward (first -> last quarter)" in proc.stderr and str(run.resolve() / "final") in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 3 and summary["paths"]["final_model"] == str(
        run.resolve() / "final")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # --log-samples 3 per step
    assert {"prompt", "response", "reward", "status", "label"} <= set(samples[0])
    assert "Which number is larger" in samples[0]["prompt"] and samples[0]["status"] in ("completed", "truncated")
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_final_model_loads_in_hf_tools_and_is_the_trained_one(finished_run, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    cwd, _ = finished_run
    final = cwd / "runs" / "latest" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template and (final / "generation_config.json").is_file()
    generate = pipeline("text-generation", model=str(final), tokenizer=str(final))
    out = generate("Which number is larger: 3 or 9?", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("Which number is larger: 3 or 9?")
    # the trained weights: the last checkpoint's, not the starting checkpoint's
    trained = _safetensors(cwd / "ckpt" / "iter_0000002" / "actor")
    exported = model.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
    start = _safetensors(Path(tiny_checkpoint))
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    # --save-hf at each save, --keep-last-n 2 keeps the two newest
    assert sorted(p.name for p in (cwd / "ckpt").glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    hf = _safetensors(cwd / "ckpt" / "iter_0000002" / "hf")
    assert set(hf) == set(_safetensors(final)) and all(torch.equal(hf[k], v) for k, v in _safetensors(final).items())
    assert AutoTokenizer.from_pretrained(cwd / "ckpt" / "iter_0000001" / "hf").chat_template


def test_runs_list_show_plot_and_replay(finished_run, tiny_checkpoint):
    cwd, _ = finished_run
    [run] = [p for p in (cwd / "runs").iterdir() if not p.is_symlink()]
    [row] = json.loads(_cli(cwd, "runs", "--json").stdout)
    assert row["name"] == run.name and row["plugins"][0] == "grpo" and row["steps"] == 3 and row["num_rollout"] == 3
    assert row["finished"] and row["final_reward"] == json.loads((run / "summary.json").read_text())["final_reward"]
    table = _cli(cwd, "runs").stdout
    assert run.name in table and "finished" in table
    shown = _cli(cwd, "runs", "show", "latest").stdout
    assert "reward (first -> last quarter)" in shown and "rollout_batch_size: 2" in shown
    _cli(cwd, "plot", "latest", "--metric", "reward", "--metric", "train/grad_norm", "-o", "curves.png")
    assert (cwd / "curves.png").read_bytes()[:4] == b"\x89PNG"
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "plot", "latest", "--metric", "rewrd"],
                          capture_output=True, text=True, cwd=cwd, timeout=120)
    assert proc.returncode == 2 and "metric 'rewrd' was never logged" in proc.stderr and "reward" in proc.stderr
    with pytest.raises(FileNotFoundError, match="no run 'nope'"):
        resolve_run("nope", cwd / "runs")

    # replay from another folder: the same resolved config (its paths absolute: --save ckpt was given relative to
    # the first run's folder) in a new run folder, with no flags but --config
    elsewhere = cwd / "elsewhere"
    elsewhere.mkdir()
    _cli(elsewhere, "train", "--config", str(run / "config.yaml"))
    replay = (elsewhere / "runs" / "latest").resolve()
    assert f"save: {cwd / 'ckpt'}" in (run / "config.yaml").read_text() and not (elsewhere / "ckpt").exists()
    strip = lambda text: [line for line in text.splitlines() if not line.startswith("#")]  # noqa: E731
    assert strip((replay / "config.yaml").read_text()) == strip((run / "config.yaml").read_text())
    assert [m["rollout/step"] for m in map(json.loads, (replay / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2]


# -- LoRA: merged model plus the adapter ----------------------------------------------------------------------


def test_lora_export_is_the_merged_model_and_keeps_the_adapter(tiny_checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slimecore.trainers.ray_actors import TrainActor

    config = Config.make(hf_checkpoint=str(tiny_checkpoint), use_lora=True, lora_rank=4, lora_alpha=8,
                         cpu_threads_per_actor=1)
    actor = TrainActor(config.to_dict(), 0, 1, "127.0.0.1", 0)
    torch.manual_seed(0)
    for name, param in actor.backend.model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapter change the model as training would
            param.data.normal_(0, 0.05)
    actor.save_hf(str(tmp_path / "final"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    actor.backend.model.eval()
    with torch.no_grad():
        expected = actor.backend.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
        assert not any("lora" in k for k in merged.state_dict())
        assert (merged(input_ids=ids).logits - expected).abs().max().item() < 1e-5
        base = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint))
        assert (base(input_ids=ids).logits - expected).abs().max().item() > 1e-3  # the adapter matters
        adapted = PeftModel.from_pretrained(base, tmp_path / "final" / "adapter")
        assert (adapted(input_ids=ids).logits - expected).abs().max().item() < 1e-5
