"""Every flag of slime's parser (THUDM/slime at the commit of tests/slime_format/slime_flags_<commit>.json, read out
of its source with ``ast``) has a decided fate in ``slimecore.defaults.slime_flags``, and ``slime-core train``'s own
parser does what the table says with a value of the kind slime defines: keeps it under the same name, maps it, or
refuses it before Ray with one line naming the flag and what to use instead. ``docs/slime-flags.md`` is current."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slimecore.config import CORE_OPTIONS, ConfigError
from slimecore.defaults.slime_compat import NAME, SLIME_FLAGS
from slimecore.sglang_schema import overrides
from slimecore_cli.main import train_config, train_plugins

sys.path.insert(0, str(Path(__file__).parent / "slime_format"))
import slime_flags  # noqa: E402  (tests/slime_format/slime_flags.py)

pytest.importorskip("slime_grpo", reason="the algorithm plugins are installed by scripts/setup.sh")
DATA = slime_flags.load()
FLAGS = {f["flag"]: f for f in DATA["flags"]}
FUNCTIONS = Path(__file__).parent / "slime_format"
M = "my_slime_functions."
BASE = ["--rollout-batch-size", "2"]
# values slime's definition cannot give (a function to import, a file to read, a template slime-core checks)
VALUES = {
    "--rollout-function-path": M + "generate_rollout", "--eval-function-path": M + "generate_rollout",
    "--custom-generate-function-path": M + "generate", "--rollout-sample-hook-path": M + "tag_sample",
    "--custom-rm-path": M + "reward_func", "--dynamic-sampling-filter-path": M + "filter_odd_groups",
    "--rollout-sample-filter-path": M + "remove_last", "--rollout-all-samples-process-path": M + "all_samples",
    "--buffer-filter-path": M + "newest_first", "--data-source-path": M + "JsonlDataSource",
    "--custom-reward-post-process-path": M + "post_process_rewards",
    "--custom-rollout-log-function-path": M + "log_rollout", "--rollout-data-postprocess-path": M + "postprocess",
    "--custom-advantage-function-path": M + "advantages", "--custom-loss-function-path": M + "custom_loss",
    "--custom-megatron-init-path": M + "init", "--load-debug-rollout-data": "dump/{rollout_id}.pt",
    "--save-debug-rollout-data": "dump/{rollout_id}.pt", "--save-hf": "hf/{rollout_id}",
    "--sglang-config": "sglang.yaml", "--rm-type": "math", "--eps-clip-c": "3", "--ref-load": "ref",
    "--opd-teacher-load": "ref",
}
# flags that need another one to mean anything (slime asserts the same pairs)
CONTEXT = {
    "--save-interval": ["--save", "ckpt"], "--save-hf": ["--save", "ckpt"], "--sglang-router-ip": [
        "--sglang-router-port", "3000"], "--sglang-router-port": ["--sglang-router-ip", "127.0.0.1"],
    "--sglang-config": ["--rollout-engine", "sglang", "--hf-checkpoint", "ckpt"],
    ("--loss-type", "custom_loss"): ["--custom-loss-function-path", M + "custom_loss"],
    **{("--advantage-estimator", e): ["--normalize-advantages"]  # slime asserts it for both REINFORCE++ variants
       for e in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")},
    "--use-dynamic-batch-size": ["--max-tokens-per-gpu", "64"], "--kl-loss-coef": ["--use-kl-loss"],
    "--opd-kl-coef": ["--opd-teacher-urls", "default=http://127.0.0.1:1"],  # the opd plugin needs a teacher
    "--use-opd": ["--opd-type", "megatron", "--opd-teacher-load", "ref"],  # slime asks for --opd-type
    "--mtp-num-layers": ["--train-backend", "megatron"], "--mtp-loss-scaling-factor": ["--train-backend", "megatron"],
    # a step picks iter_0000002 of a Megatron-LM checkpoint root (user_dir's "mlm")
    "--ref-ckpt-step": ["--train-backend", "megatron", "--ref-load", "mlm"],
    "--opd-teacher-ckpt-step": ["--train-backend", "megatron", "--opd-teacher-load", "mlm"],
}
# values of a same or mapped flag that slime-core refuses, with what to use (the table's text says so)
REFUSED_VALUES = {("--advantage-estimator", "cispo"), ("--loss-type", "sft_loss")}


def _values(flag: dict) -> list[list[str]]:
    """Command-line values of the kind slime defines for ``flag``: none for a switch, each choice, two of a list."""
    name = flag["flag"]
    if name in VALUES:
        return [[VALUES[name]]]
    if flag["action"] in ("store_true", "store_false", "BooleanOptionalAction"):
        return [[]]
    if flag["choices"]:
        return [[str(c)] for c in flag["choices"]]
    kind = {"int": "2", "float": "0.5", "json.loads": '{"k": 1}'}.get(flag["type"], "x")
    if flag["type"] in (None, "str") and isinstance(flag["default"], str) and flag["default"]:
        kind = flag["default"]
    return [[kind, kind]] if flag["nargs"] in ("+", "*") else [[kind]]


def _typed(flag: dict, words: list[str]):
    """The value slime's parser would store for ``words`` (the switch's True for a flag without words)."""
    if not words:
        return True
    convert = {"int": int, "float": float, "json.loads": json.loads}.get(flag["type"], str)
    values = [convert(w) for w in words]
    return values if flag["nargs"] in ("+", "*") or flag["action"] == "append" else values[0]


def _held(config, name: str):
    """Where slime-core keeps a same-named option: core, a plugin's options, SGLang's or Megatron's arguments."""
    state = config.to_dict()
    if name in state["values"]:
        return state["values"][name]
    for values in state["plugin_values"].values():
        if name in values:
            return values[name]
    if name.startswith("sglang_") and name[len("sglang_"):] in state["sglang_args"]:
        return state["sglang_args"][name[len("sglang_"):]]  # a string: the SGLang server types it
    return state["megatron_args"].get(name, KeyError)


def _parse(argv: list[str]):
    return train_config(train_plugins(argv))[0]


@functools.cache
def _baseline(base: tuple) -> dict | None:
    """The config without the flag under test (None where the flag is one of a pair, --sglang-router-ip/port)."""
    try:
        return _parse(list(base)).to_dict()
    except ConfigError:
        return None


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("slime-flags")
    (path / "my_slime_functions.py").write_text((FUNCTIONS / "my_slime_functions.py").read_text())
    (path / "x").write_text("call_log: calls.jsonl\n")  # --custom-config-path / --eval-config "x"
    (path / "ref").mkdir()
    (path / "ref" / "config.json").write_text("{}")  # an HF directory for --ref-load (read by the trainers)
    (path / "mlm" / "iter_0000002").mkdir(parents=True)  # a Megatron-LM checkpoint root for --ref-ckpt-step 2
    (path / "mlm" / "iter_0000002" / "metadata.json").write_text("{}")
    (path / "mlm" / "latest_checkpointed_iteration.txt").write_text("2")
    (path / "sglang.yaml").write_text("sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n"
                                      "        num_gpus: 1\n        overrides: {mem_fraction_static: 0.7}\n")
    return path


@pytest.fixture
def workdir(user_dir, monkeypatch):
    """The user's directory, where slime-core starts: the --*-path functions import from it, as in slime."""
    monkeypatch.chdir(user_dir)
    return user_dir


def test_every_slime_flag_has_a_decided_fate():
    undecided = sorted(set(FLAGS) - set(SLIME_FLAGS))
    assert not undecided, f"flags of slime {DATA['commit'][:7]} with no fate in slime_flags.SLIME_FLAGS: {undecided}"
    stale = sorted(set(SLIME_FLAGS) - set(FLAGS))
    assert not stale, f"SLIME_FLAGS has flags slime's parser does not define: {stale}"
    assert {fate.kind for fate in SLIME_FLAGS.values()} == {"same", "mapped", "refused"}
    assert all(fate.text and fate.instead for fate in SLIME_FLAGS.values() if fate.kind == "refused")


def test_the_data_is_slime_parser_source():
    """The test data names its commit and the source places of each flag; the extractor reads a definition."""
    assert len(DATA["commit"]) == 40 and slime_flags.data_file().name == f"slime_flags_{DATA['commit'][:7]}.json"
    assert len(FLAGS) == len(DATA["flags"]) > 200
    [flag] = slime_flags.extract('def f(p):\n    p.add_argument("--a-b", type=int, nargs="+", default=[1], '
                                 'help="x")\n', "f.py")
    assert flag | {"file": "f.py"} == {"flag": "--a-b", "file": "f.py", "line": 2, "megatron_reset": False,
                                       "action": None, "type": "int", "nargs": "+", "choices": None,
                                       "default": [1], "dest": "a_b", "help": "x"}


MAPPED = {  # each mapped flag: what the parser must have made of (value)
    "--advantage-estimator": lambda c, v: {"grpo": "grpo", "gspo": "gspo"}.get(v, "ppo") in c.plugins and (
        v in ("grpo", "gspo") or c.plugin("ppo").advantage_estimator == v),
    "--use-opd": lambda c, v: "opd" in c.plugins and c.plugin("opd").opd_teacher_load == "ref",
    "--update-weight-transport": lambda c, v: c.update_weight_transport == {"nccl": "distributed"}.get(v, v),
    "--sglang-config": lambda c, v: overrides(c) == {"mem_fraction_static": 0.7},  # slime's server-group form
    **{f"--wandb-{k}": lambda c, v, k=k: vars(c.plugin(NAME))[f"wandb_{k.replace('-', '_')}"] == v
       for k in ("key", "host", "team", "run-id")},
}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_slime_core_train_parses_the_flag_as_its_fate_says(name, workdir):
    flag, fate = FLAGS[name], SLIME_FLAGS[name]
    plugin = ["--plugin", fate.plugin] if fate.plugin in ("grpo", "ppo", "opd") else []
    base = BASE + plugin + CONTEXT.get(name, [])
    baseline = _baseline(tuple(base))
    for words in _values(flag):
        argv = base + CONTEXT.get((name, " ".join(words)), []) + [name, *words]
        if (fate.kind == "refused" and " ".join(words) not in fate.accepted) or (name, " ".join(words)) in \
                REFUSED_VALUES:
            with pytest.raises(ConfigError) as err:
                _parse(argv)
            message = str(err.value)
            assert "\n" not in message and message.startswith(name) and "; instead: " in message, message
            continue
        config = _parse(argv)
        value = _typed(flag, words)
        if fate.kind == "mapped":
            assert MAPPED[name](config, value), (argv, config)
            continue
        held = _held(config, name[2:].replace("-", "_"))
        if fate.kind == "refused":  # a value that means what slime-core does: kept as given
            assert held == words, (argv, held)
            continue
        assert held == value or (name.startswith("--sglang-") and held == str(value)), \
            f"{argv}: slime-core holds {held!r}, slime {value!r}"
        if baseline and value != baseline["values"].get(name[2:].replace("-", "_"), value):
            assert config.to_dict() != baseline, f"{argv} was accepted and changed nothing"


def test_every_no_switch_is_set_by_its_flag(workdir):
    """argparse's BooleanOptionalAction reads any "--no-..." flag as False: a switch named no_* must not use it."""
    switches = [o.flag for o in CORE_OPTIONS if o.type is bool and o.name.startswith("no_")]
    assert switches  # --no-save-optim
    config = _parse(BASE + switches)
    assert all(getattr(config, flag[2:].replace("-", "_")) is True for flag in switches)
    loaded = train_plugins(["--plugin", "grpo", "--plugin", "ppo", "--plugin", "gspo", "--plugin", "sft"])
    plugin_switches = [o.flag for options in loaded[3].values() for o in options
                       if o.type is bool and o.name.startswith("no_")]
    if plugin_switches:
        config = _parse(BASE + ["--plugin", "grpo", *plugin_switches])
        assert all(_held(config, f[2:].replace("-", "_")) is True for f in plugin_switches)


def test_repeated_hook_paths_are_all_kept(workdir):
    config = _parse(BASE + ["--rollout-sample-hook-path", M + "tag_sample", "--rollout-sample-hook-path",
                            M + "tag_sample", M + "tag_sample"])
    assert config.plugin("slimecore.defaults.slime_compat").rollout_sample_hook_path == [M + "tag_sample"] * 3


def test_save_hf_takes_slimes_path_template(workdir):
    from slimecore.checkpoint import save_hf_dir

    for save_hf, expected in ((["hf/iter_{rollout_id}"], "hf/iter_3"), (["hf"], "hf/iter_0000003"),
                              ([], "ckpt/iter_0000003/hf")):
        config = _parse(BASE + ["--save", "ckpt", "--save-hf", *save_hf])
        assert save_hf_dir(config, 3) == expected


@pytest.mark.parametrize("argv,message", [
    (["--advantage-estimator", "cispo"], "--advantage-estimator cispo: no slime-core algorithm plugin implements it"),
    (["--plugin", "grpo", "--advantage-estimator", "gspo"],
     "--advantage-estimator gspo selects plugin 'gspo', but --plugin grpo is given too"),
])
def test_advantage_estimator_names_what_is_missing(argv, message, workdir):
    with pytest.raises(ConfigError, match=message):
        _parse(BASE + argv)


def test_advantage_estimator_of_a_plugin_not_installed(workdir, monkeypatch):
    monkeypatch.setenv("SLIMECORE_BLOCK_PLUGINS", "gspo")
    with pytest.raises(ConfigError, match="needs the algorithm plugin 'gspo', which is not installed: pip install "):
        _parse(BASE + ["--advantage-estimator", "gspo"])


def test_wandb_flags_become_wandbs_environment(workdir, monkeypatch):
    for env in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(env, raising=False)
    loaded = train_plugins(BASE + ["--wandb-key", "k", "--wandb-host", "https://w.example", "--wandb-team", "t",
                                   "--wandb-run-id", "r1"])
    config, hooks, _ = train_config(loaded)
    hooks.slime_startup(config=config, process="driver")
    assert [os.environ[e] for e in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_RUN_ID",
                                    "WANDB_RESUME")] == ["k", "https://w.example", "t", "r1", "allow"]


def test_the_doc_is_generated_from_the_table():
    assert slime_flags.DOC.read_text() == slime_flags.render(DATA, SLIME_FLAGS), \
        "docs/slime-flags.md is stale: python tests/slime_format/slime_flags.py doc"


def test_a_refused_flag_stops_the_run_before_ray_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--advantage-estimator", "grpo",
                           "--rollout-batch-size", "2", "--use-opd", "--opd-type", "sglang"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert " ".join(proc.stderr.split()).startswith("error: --opd-type sglang is not supported by slime-core: slime's "
                                                    "sglang type asks a teacher server through its reward function")
    assert not (tmp_path / "runs").exists()  # stopped before the run folder, Ray, or a model


def test_balance_data_evens_out_the_ranks_tokens():
    """slime's --balance-data: micro-batches of 10, 9, 8 and 1 tokens on 2 ranks are 18 / 10 tokens round-robin,
    11 / 17 by the greedy balance; every rank still gets two micro-batches, and every sample is trained once."""
    from slimecore.rollout.schedule import build_dp_schedule

    lengths = [10, 9, 8, 1]
    tokens = {}
    for balance in (False, True):
        [step] = build_dp_schedule([0, 1, 2, 3], lengths, global_batch_size=4, dp_size=2, micro_batch_size=1,
                                   balance=balance).steps
        assert [len(mbs) for mbs in step.rank_micro_batches] == [2, 2]
        assert sorted(i for mbs in step.rank_micro_batches for mb in mbs for i in mb) == [0, 1, 2, 3]
        tokens[balance] = sorted(sum(lengths[i] for mb in mbs for i in mb) for mbs in step.rank_micro_batches)
    assert tokens == {False: [10, 18], True: [11, 17]}
    assert _parse(BASE + ["--balance-data"]).balance_data is True


@pytest.fixture(scope="module")
def two_tiny_qwen3(tmp_path_factory):
    """Two tiny Qwen3 checkpoints of one shape and different weights: the policy's and --ref-load's."""
    from slimecore.testing.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ref-load")
    return make_tiny_checkpoint(root / "policy", "qwen3", seed=0), make_tiny_checkpoint(root / "ref", "qwen3", seed=1)


def test_ref_load_is_the_reference_and_the_start_on_fsdp(two_tiny_qwen3):
    """As in slime: --ref-load's weights are the reference policy, and the policy starts from them (the engines get
    them at the first sync); after the policy moves, the reference forward still sees --ref-load's weights."""
    import torch
    from safetensors.torch import load_file

    from slimecore.config import Config
    from slimecore.trainers.fsdp import FSDPBackend

    policy, reference = two_tiny_qwen3
    expected = load_file(str(reference / "model.safetensors"))
    backend = FSDPBackend(Config.make(hf_checkpoint=str(policy), ref_load=str(reference)), keep_reference=True)
    params = dict(backend.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in expected.items() if k in params)
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
        with backend.reference_weights():
            assert all(torch.equal(params[k], v) for k, v in expected.items() if k in params)
    assert all(torch.equal(params[k], v + 1.0) for k, v in expected.items() if k in params)


@pytest.mark.parametrize("backend,message", [
    ("fsdp", "--ref-load {}: not an HF checkpoint directory (no config.json)"),
    ("megatron", "--ref-load {}: not an HF checkpoint directory (no config.json) nor a torch_dist one"),
])
def test_ref_load_that_the_backend_cannot_read_is_refused_before_ray(backend, message, tmp_path, workdir):
    with pytest.raises(ConfigError, match=re.escape(message.format(tmp_path))):
        _parse(BASE + ["--train-backend", backend, "--ref-load", str(tmp_path)])
    (tmp_path / "megatron_checkpoint.json").write_text("{}")
    with pytest.raises(ConfigError, match="a torch_dist checkpoint, which --train-backend fsdp cannot read"):
        _parse(BASE + ["--ref-load", str(tmp_path)])


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_models")),
                    reason="needs megatron-core, mbridge and the models plugin")
def test_ref_load_on_megatron_from_hf_and_torch_dist(two_tiny_qwen3, tmp_path):
    import ref_load_checks

    from slimecore.testing.distributed import run_ranks

    policy, reference = two_tiny_qwen3
    [r] = run_ranks(ref_load_checks.megatron_ref_load, str(policy), str(reference), str(tmp_path / "ref_dist"),
                    world=1, timeout=300)
    for source in ("hf", "torch_dist"):
        assert r[source]["start_vs_ref_load"] == 0 and r[source]["reference_vs_ref_load"] == 0, r
        assert r[source]["start_vs_hf_checkpoint"] > 0.01, r  # the two checkpoints differ


def test_allgather_cp_is_refused_only_with_context_parallelism(workdir):
    assert _parse(BASE + ["--allgather-cp"]).context_parallel_size == 1  # glm5's model files: nothing to gather
    with pytest.raises(ConfigError, match="^--allgather-cp is not supported by slime-core: with "
                                          "--context-parallel-size > 1"):
        _parse(BASE + ["--allgather-cp", "--context-parallel-size", "2"])


def test_an_external_router_takes_the_engines_and_custom_functions_use_it(tiny_checkpoint, user_dir, tmp_path):
    """slime's --sglang-router-ip/port: the run starts no router; its engines register with the one given (a real
    sglang-router the test started), slime's custom generate function posts to args.sglang_router_ip/port and is
    answered through it, and when the run ends the router is still up, without the run's engines."""
    from slimecore.engines.router import Router

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input": f"Count to {i}:"}) + "\n" for i in range(4)))
    (tmp_path / "custom.yaml").write_text(f"call_log: {tmp_path / 'calls.jsonl'}\n")
    (tmp_path / "my_slime_functions.py").write_text((FUNCTIONS / "my_slime_functions.py").read_text())
    router = Router([], log_dir=str(tmp_path)).spawn()
    try:
        router.wait_ready(0)
        proc = subprocess.run(
            [sys.executable, "-m", "slimecore_cli", "train", "--advantage-estimator", "grpo", "--hf-checkpoint",
             str(tiny_checkpoint), "--prompt-data", "prompts.jsonl", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
             "--log-dir", str(tmp_path / "run"), "--no-use-tensorboard", "--custom-config-path", "custom.yaml",
             "--custom-generate-function-path", M + "generate", "--rm-type", "random",
             "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(router.port)],
            cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
        assert {c["router"] for c in calls if c["what"] == "generate"} == {f"{router.url}/generate"}
        assert sum(c["what"] == "generate" for c in calls) == 4
        assert router.running and router.list_workers() == []  # the run took its engines out again
    finally:
        router.stop()


def test_an_external_router_that_does_not_answer_stops_the_run_before_ray(tmp_path, tiny_checkpoint):
    from slimecore.engines.router import free_port

    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--advantage-estimator", "grpo",
                           "--hf-checkpoint", str(tiny_checkpoint), "--rollout-batch-size", "2", "--num-rollout", "1",
                           "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(port)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"no sglang-router answers at http://127.0.0.1:{port}" in " ".join(proc.stderr.split())


def test_a_slime_scripts_megatron_flags_mean_slimes_megatron_backend(workdir):
    """slime trains with Megatron only: with no --train-backend, a Megatron-only argument (--optimizer ...) selects
    megatron and the installed models plugin for its bridge; flags that only describe the model stay on fsdp (which
    checks them against config.json); an explicit --train-backend wins. As Megatron-LM, --sequence-parallel with one
    tensor-parallel rank is off (nothing to split)."""
    from slimecore.preflight import may_have_gpus

    config = _parse(BASE + ["--optimizer", "adam"])
    assert config.train_backend == "megatron" and "models" in config.plugins
    assert _parse(BASE + ["--num-layers", "2"]).train_backend == "fsdp"
    assert _parse(BASE + ["--train-backend", "fsdp", "--optimizer", "adam"]).train_backend == "fsdp"
    assert _parse(BASE + ["--sequence-parallel"]).sequence_parallel is False
    assert _parse(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"]).sequence_parallel is True
    if not may_have_gpus():  # --colocate's trainer offload: on CPU the state is in host memory already
        assert _parse(BASE + ["--optimizer", "adam", "--colocate"]).offload_train is False


def test_slimes_opd_megatron_flags_pass_the_checks_before_ray(two_tiny_qwen3, workdir, tmp_path):
    """The flags of slime's examples/on_policy_distillation/run-qwen3-8B-opd-megatron.sh (its GRPO_ARGS and
    OPTIMIZER_ARGS as written; paths and sizes for this machine): megatron (--optimizer), grpo with the opd plugin
    whose teacher is the trainer's, through every check before Ray; a teacher of another shape stops there."""
    from slimecore.startup import prepare
    from slimecore.testing.tiny import make_tiny_checkpoint

    policy, teacher = two_tiny_qwen3
    (tmp_path / "dapo.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} + 1?"}],
                                                             "label": str(i + 1)}) + "\n" for i in range(4)))
    grpo_args = ["--advantage-estimator", "grpo", "--use-opd", "--opd-type", "megatron", "--opd-kl-coef", "1.0",
                 "--opd-teacher-load", str(teacher), "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
                 "low_var_kl", "--entropy-coef", "0.00"]
    optimizer_args = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                      "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
    rest = ["--hf-checkpoint", str(policy), "--ref-load", str(policy), "--prompt-data", str(tmp_path / "dapo.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rm-type", "math", "--log-dir",
            str(tmp_path / "run")]
    config, hooks, _ = train_config(train_plugins(grpo_args + optimizer_args + rest))
    assert config.train_backend == "megatron" and {"grpo", "opd", "models"} <= set(config.plugins)
    assert config.plugin("opd").opd_teacher_load == str(teacher) and config.plugin("opd").opd_kl_coef == 1.0
    assert hooks.slime_scoring_weights(config=config, role="actor") == {"teacher_log_probs": str(teacher)}
    prepare(config, hooks)
    wider = make_tiny_checkpoint(tmp_path / "wider", "qwen3", hidden=96, seed=2)
    args = [wider if a == str(teacher) else a for a in grpo_args]
    config, hooks, _ = train_config(train_plugins([*map(str, args), *optimizer_args, *rest[:-1], str(tmp_path / "r2")]))
    with pytest.raises(ConfigError, match="^the teacher_log_probs checkpoint .* is not of the policy's architecture"):
        prepare(config, hooks)
