"""What the small commands print, at 80 columns and into pipes: tables wrap between words or drop columns
(never a cell cut to "…"), paths are printed whole, and the listings are cached so they answer at once."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from rich.console import Console

from slimecore.display import RunDisplay
from slimecore_cli.main import plugins_table
from slimecore_cli.runs import runs_table

HOOKS = ["slime_buffer_filter", "slime_compute_advantages", "slime_data_source", "slime_filter_group",
         "slime_generate", "slime_loss", "slime_post_process_rewards", "slime_rollout_data_postprocess"]


def _render(renderable, width: int = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(renderable)
    return out.getvalue()


def _words_whole(text: str, values: list[str]) -> None:
    assert "…" not in text, text
    lines = text.splitlines()
    for value in values:
        for word in value.split():
            assert any(word in line for line in lines), (word, text)


def test_plugins_table_at_80_columns_keeps_names_and_hooks_whole():
    rows = [{"name": name, "distribution": dist, "version": "0.1.0", "hooks": HOOKS[:n], "origin": origin,
             "location": f"/somewhere/{name}.py"}
            for name, dist, n, origin in [("slimecore.defaults.slime_compat", "slime-core", 8, "built-in"),
                                          ("reasoning_gym", "slime-core-reasoning-gym", 3, "entry point"),
                                          ("grpo", "slime-core-grpo", 5, "entry point")]]
    text = _render(plugins_table(rows, 80))
    assert max(map(len, text.splitlines())) <= 80
    _words_whole(text, [r["name"] for r in rows] + [h.removeprefix("slime_") + "," for h in HOOKS[:-1]])
    assert "plugin" in text and "hooks" in text and "entry point" in text and "0.1.0" in text
    assert "slime-core-reasoning-gym" not in text  # the distribution is left to --json at 80 columns
    wide = _render(plugins_table(rows, 200), 200)
    assert "slime-core-reasoning-gym" in wide and "entry point" in wide  # nothing dropped where it fits


def test_runs_table_at_80_columns_keeps_run_names_and_values_whole():
    rows = [{"name": f"20261128-0930{i:02d}-grpo+digits_reward_plugin", "started": "2026-11-28 09:30",
             "plugins": ["grpo", "/home/me/digits_reward_plugin.py"], "steps": 3, "num_rollout": 30,
             "final_reward": 0.703125, "finished": i == 0, "summary": {"completed": i == 0}} for i in range(2)]
    text = _render(runs_table(rows, "runs", 80))
    assert max(map(len, text.splitlines())) <= 80
    _words_whole(text, [r["name"] for r in rows] + ["3/30", "0.703", "steps", "final reward"])


def test_the_end_summary_at_80_columns_prints_every_path_whole_on_its_line(tmp_path):
    run = tmp_path / "a-rather-long-folder-name-for-runs" / "runs" / "20261128-093000-grpo+digits_reward_plugin"
    paths = {"run": str(run), "final_model": str(run / "final"), "curves": str(run / "curves.png"),
             "metrics": str(run / "metrics.jsonl"), "checkpoints": str(tmp_path / "ckpt")}
    out = io.StringIO()
    RunDisplay(Console(file=out, width=80), None, live=False).summary(
        {"steps": 30, "completed": True, "reward_first_quarter": 0.25, "reward_last_quarter": 0.7,
         "wall_seconds": 2581.0, "step_time_median": 70.4, "paths": paths})
    text = out.getvalue()
    assert "…" not in text and "0.250 -> 0.700 (+0.450)" in text and "43m01s (median step 70.4s)" in text
    assert "time (whole command)" in text
    for label, key in [("run folder", "run"), ("trained model (HF)", "final_model"), ("checkpoints", "checkpoints")]:
        assert f"{label}: {paths[key]}" in text.splitlines()  # one line, unsplit, copyable


def test_plugins_listing_is_cached_by_distribution_and_file(tmp_path):
    """The second `slime-core plugins` reads the cache and imports no plugin."""
    env_code = ("import json, sys; from slimecore_cli.plugin_list import plugin_rows; seen = []; "
                "rows = plugin_rows(on_import=seen.extend); print(json.dumps([seen, [r['name'] for r in rows], "
                "sorted(m for m in sys.modules if m.startswith('slimecore.defaults'))]))")

    def listing():
        proc = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "SLIMECORE_CACHE": str(tmp_path),
                                   "SLIMECORE_LOAD_PLUGINS": "grpo"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    imported, names, modules = listing()
    assert "grpo" in imported and names[-1] == "grpo" and "slimecore.defaults.slime_compat" in names
    imported, names_again, modules = listing()
    assert imported == [] and names_again == names and modules == []  # from the cache: nothing imported
    assert (tmp_path / "plugins.json").is_file()


def _option_text(text: str, flag: str) -> str:
    """The lines of ``flag``'s entry in a help text (its first line up to the next option)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} ") or line == f"  {flag}"
                 or line.startswith(f"  {flag},"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 34)), len(lines))
    return " ".join(line.strip() for line in lines[start:end])


def test_train_help_is_short_grouped_and_shows_each_type_and_default():
    import pytest

    pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--help"],
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                             "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    headers = [line.split(" (")[0].rstrip(":") for line in text.splitlines() if line and not line.startswith(" ")
               and line.endswith(":")]
    assert headers == ["core", "data", "rollout", "algorithm plugin", "backend", "engine", "advanced"]
    assert len(text.splitlines()) < 200 and "PLUGIN." not in text and "(required)" not in text
    assert "[default 0.2]" in _option_text(text, "--eps-clip FLOAT")
    assert "default 1e-06; quick start: 1e-05 without --prompt-data" in _option_text(text, "--lr FLOAT")
    assert "[default 1.0]" in _option_text(text, "--rollout-temperature FLOAT")
    assert "[default 0.0]" in _option_text(text, "--kl-loss-coef FLOAT")
    assert "default 1; quick start: 8" in _option_text(text, "--n-samples-per-prompt INT")
    assert "quick start: 8 without --prompt-data" in _option_text(text, "--rollout-batch-size INT")
    assert "[default off]" in _option_text(text, "--colocate, --no-colocate")
    assert "--save DIR" in text and "--prompt-data FILE" in text
    every = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--help-all"], capture_output=True,
                           text=True, timeout=120).stdout
    assert "-> transformer.num_layers" in _option_text(every, "--num-layers INT")  # Megatron's pass-through
    assert "--rollout-function-path TEXT" in every and "--rollout-function-path" not in text  # advanced: all only
    assert "sglang (--rollout-engine sglang" in every
    from slimecore.plugins import load_plugins
    from slimecore_cli.help import train_help

    hooks = load_plugins(["grpo"])
    narrow = train_help(hooks, hooks.slime_options(), width=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80  # wrapped to the terminal


def test_the_live_bar_at_80_columns_keeps_the_step_count_and_times_whole():
    import re

    out = io.StringIO()
    display = RunDisplay(Console(file=out, force_terminal=True, width=80), total=40, live=True)
    with display:
        display.step(9, 40, {"rollout/raw_reward": 0.25, "rollout/response_length": 12.5, "perf/step_time": 1.5})
        display.stage("train", 10)
        display.progress.refresh()
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    [bar] = [line for line in text.splitlines() if "step 11: training" in line][-1:]
    assert "10/40" in bar and "ETA 45s" in bar and len(bar) <= 80  # the last step's figures give way first


def test_models_at_80_columns_keeps_every_cell_whole():
    import pytest
    from click.testing import CliRunner

    from slimecore_cli.main import cli

    pytest.importorskip("slime_models", reason="the models plugin is installed by scripts/setup.sh")
    wide = json.loads(CliRunner().invoke(cli, ["models", "--json"], catch_exceptions=False).output)
    text = CliRunner().invoke(cli, ["models"], env={"COLUMNS": "80"}, catch_exceptions=False).output
    assert max(map(len, text.splitlines())) <= 80
    _words_whole(text, [row["preset"] for row in wide] + ["layers", "heads", "experts"])
