"""The built-in slime adapter: slime users' functions, in slime's signatures and importing ``slime``, run
unchanged in real ``slime-core train`` runs (tests/slime_format/my_slime_functions.py); refused flags and bad
paths fail before Ray starts with what to do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slimecore.config import Config, ConfigError
from slimecore.defaults import slime_compat
from slimecore.defaults.slime_compat import NAME, REFUSED, WIRED, make_args
from slimecore.plugins import load_plugins
from slimecore.rollout.hook_args import buffer_filter

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
FUNCTIONS = Path(__file__).parent / "slime_format" / "my_slime_functions.py"
M = "my_slime_functions."


@pytest.fixture
def workdir(tmp_path):
    """A user's directory: their functions file, prompts and a --custom-config-path YAML."""
    shutil.copy(FUNCTIONS, tmp_path / FUNCTIONS.name)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"input": f"Count to {i}:", "label": str(i)}) + "\n" for i in range(16)))
    (tmp_path / "custom.yaml").write_text(f"call_log: {tmp_path / 'calls.jsonl'}\n")
    return tmp_path


def _train(workdir: Path, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *extra], cwd=workdir, capture_output=True,
                          text=True, timeout=timeout)


def _calls(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "calls.jsonl").read_text().splitlines()]


def _common(tiny_checkpoint, workdir):
    return ["--plugin", "grpo", "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", "prompts.jsonl",
            "--label-key", "label", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "2", "--log-dir", str(workdir / "run"),
            "--no-use-tensorboard", "--custom-config-path", "custom.yaml"]


def test_generate_reward_filter_hooks_and_loss_replace_grpos(tiny_checkpoint, workdir):
    proc = _train(workdir, *_common(tiny_checkpoint, workdir), "--over-sampling-batch-size", "4",
                  "--custom-generate-function-path", M + "generate", "--custom-rm-path", M + "reward_func",
                  "--dynamic-sampling-filter-path", M + "filter_odd_groups",
                  "--rollout-sample-hook-path", M + "tag_sample", "--rollout-sample-filter-path", M + "remove_last",
                  "--rollout-data-postprocess-path", M + "postprocess",
                  "--custom-loss-function-path", M + "custom_loss", "--loss-type", "custom_loss",
                  "--rollout-all-samples-process-path", M + "all_samples",
                  "--custom-reward-post-process-path", M + "post_process_rewards",
                  "--custom-rollout-log-function-path", M + "log_rollout", "--custom-megatron-init-path", M + "init")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:
        assert "train/custom_pg_loss" in step and "train/custom_entropy" in step  # the custom loss trained ...
        assert "train/pg_clipfrac" not in step  # ... instead of grpo's policy loss
        assert step["rollout/my_sample_count"] == 4  # the rollout log function's own metric
    calls = _calls(workdir)
    kinds = {c["what"] for c in calls}
    assert kinds >= {"generate", "reward", "filter", "sample_filter", "postprocess", "loss", "post_process",
                     "log_rollout", "init"}
    assert {c["backend"] for c in calls if c["what"] == "init"} == {"fsdp"}
    # each odd group the filter saw was dropped and counted (which groups finish before the target is met varies)
    filtered = [c["group_index"] for c in calls if c["what"] == "filter"]
    assert sum(step.get("rollout/dynamic_filter/drop_odd_group", 0) for step in steps) == \
        sum(i % 2 for i in filtered)
    # every group the filter saw reaches the all-samples function, the dropped ones included
    seen = [i for c in calls if c["what"] == "all_samples" for i in c["group_indices"]]
    assert sorted(seen) == sorted(filtered) and any(i % 2 == 0 for i in seen)
    assert all(c["status"] in ("completed", "truncated") for c in calls if c["what"] == "generate")
    assert {c["eps_clip"] for c in calls if c["what"] == "reward"} == {0.2}  # grpo's option, under slime's name
    assert {c["loss_type"] for c in calls if c["what"] == "loss"} == {"custom_loss"}
    # trained samples come from even groups only (the filter), and the last of each group has no loss tokens
    for post in (c for c in calls if c["what"] == "postprocess"):
        assert all((index // 2) % 2 == 0 for index in post["sample_indices"])
        # (the trainer's micro-batches run longest first, so a group's samples need not stay in order)
        last = [m for i, m in zip(post["sample_indices"], post["loss_mask_sums"]) if i % 2 == 1]
        assert last == [0] * (len(post["sample_indices"]) // 2)
        assert {"unconcat_tokens", "total_lengths", "raw_reward", "advantages", "log_probs"} <= set(post["keys"])
    driver = {c["pid"] for c in calls if c["what"] == "loss"} & {c["pid"] for c in calls if c["what"] == "reward"}
    assert not driver  # the loss ran in a train actor, the reward in the rollout manager


def test_rollout_function_data_source_advantages_and_eval(tiny_checkpoint, workdir):
    proc = _train(workdir, *_common(tiny_checkpoint, workdir), "--rollout-function-path", M + "generate_rollout",
                  "--data-source-path", M + "JsonlDataSource", "--custom-advantage-function-path", M + "advantages",
                  "--eval-prompt-data", "cmp", "task:compare", "--eval-interval", "2", "--skip-eval-before-train",
                  "--save", str(workdir / "ckpt"), "--save-interval", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["rollout/my_rollout_groups"] for s in steps] == [2, 2]
    assert "train/pg_clipfrac" in steps[0]  # grpo's loss, on the custom advantages
    assert 0.0 <= steps[1]["eval/cmp"] <= 1.0
    calls = _calls(workdir)
    rollouts = [(c["rollout_id"], c["evaluation"]) for c in calls if c["what"] == "rollout"]
    assert rollouts == [(0, False), (1, False), (2, True)]
    assert [c["rollout_id"] for c in calls if c["what"] == "source_save"] == [0, 1]
    assert (workdir / "ckpt" / "my_source_1.json").is_file()
    assert [c["n"] for c in calls if c["what"] == "advantages"] == [4, 4]


def _validate(**flags):
    config = Config.make(plugin_values={NAME: flags})
    load_plugins([]).bind(config).slime_validate_config(config=config)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_say_why_and_what_to_use(flag):
    with pytest.raises(ConfigError, match=f"^--{flag.replace('_', '-')} x.y is not supported by slime-core: .+; instead: "):
        _validate(**{flag: "x.y"})


def test_every_slime_path_flag_is_wired_or_refused():
    slime_flags = {"rollout_function_path", "eval_function_path", "custom_generate_function_path",
                   "rollout_sample_hook_path", "custom_rm_path", "dynamic_sampling_filter_path",
                   "rollout_sample_filter_path", "rollout_all_samples_process_path", "buffer_filter_path",
                   "data_source_path", "custom_reward_post_process_path", "custom_convert_samples_to_train_data_path",
                   "custom_rollout_log_function_path", "custom_eval_rollout_log_function_path",
                   "rollout_data_postprocess_path", "custom_advantage_function_path", "custom_loss_function_path",
                   "custom_tis_function_path", "custom_pg_loss_reducer_function_path", "custom_model_provider_path",
                   "custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                   "custom_megatron_before_train_step_hook_path", "custom_update_weight_post_write_path",
                   "megatron_config_path", "custom_config_path"}  # the 26 of slime/utils/arguments.py
    assert set(WIRED) | set(REFUSED) == slime_flags and not set(WIRED) & set(REFUSED)
    doc = (Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
    for flag in slime_flags:
        assert f"`--{flag.replace('_', '-')}`" in doc, flag


@pytest.mark.parametrize("flags,message", [
    ({"custom_rm_path": "no_such_module.fn"}, "cannot import it (ModuleNotFoundError"),
    ({"custom_rm_path": "sync_rm.reward_func"}, "slime awaits this function, so it must be declared `async def`"),
    ({"custom_rm_path": "sync_rm.missing"}, "cannot import it (AttributeError"),
    ({"custom_rm_path": "sync_rm"}, "is not a dotted path"),
    ({"data_source_path": "sync_rm.reward_func"}, "slime instantiates this path as cls(args); it must name a class"),
    ({"loss_type": "custom_loss"}, "--loss-type custom_loss needs --custom-loss-function-path"),
    ({"loss_type": "sft_loss"}, "--loss-type sft_loss: in slime-core that loss is a plugin's; instead: --plugin sft"),
])
def test_bad_paths_and_loss_types_are_named(tmp_path, flags, message):
    (tmp_path / "sync_rm.py").write_text("def reward_func(args, sample):\n    return 1.0\n")
    with pytest.raises(ConfigError) as err:
        _validate(slime_sys_path=[str(tmp_path)], **flags)
    assert message in str(err.value)


def test_a_bad_path_fails_before_ray(workdir):
    proc = _train(workdir, "--plugin", "grpo", "--rollout-batch-size", "2", "--custom-generate-function-path",
                  M + "no_such_function", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--custom-generate-function-path my_slime_functions.no_such_function: cannot import it" in \
        " ".join(proc.stderr.split())
    assert "Started a local Ray instance" not in proc.stderr


def test_buffer_filter_picks_the_buffered_groups_the_data_source_serves(workdir, tiny_checkpoint):
    from slimecore.hf_checkpoint import load_tokenizer

    config = Config.make(prompt_data=str(workdir / "prompts.jsonl"), label_key="label", n_samples_per_prompt=2,
                         plugin_values={NAME: {"buffer_filter_path": M + "newest_first", "slime_sys_path": [
                             str(workdir)], "custom_config_path": str(workdir / "custom.yaml")}})
    hooks = load_plugins([]).bind(config)
    source = hooks.slime_data_source(config=config, tokenizer=load_tokenizer(tiny_checkpoint),
                                     buffer_filter=buffer_filter(hooks, config))
    first = source.get_samples(3)
    source.add_samples(first)  # three aborted groups back in the buffer
    again = source.get_samples(2)
    assert [g[0].group_index for g in again] == [2, 1]  # the user's filter: newest first
    assert [g[0].group_index for g in source.buffer] == [0]
    assert [(c["rollout_id"], c["taken"]) for c in _calls(workdir) if c["what"] == "buffer_filter"] == [(None, 2)]


def test_group_rm_calls_the_batched_form(workdir, monkeypatch):
    import asyncio

    from slimecore.types import Sample

    config = Config.make(group_rm=True, plugin_values={NAME: {"custom_rm_path": M + "batched_reward_func",
                                                              "slime_sys_path": [str(workdir)]}})
    hooks = load_plugins([]).bind(config)
    assert hooks.plugin_name(hooks.answerer("slime_group_reward")) == NAME and not hooks.is_default(
        hooks.answerer("slime_group_reward"))
    samples = [Sample(response="ab"), Sample(response="abcd")]
    assert asyncio.run(hooks.slime_group_reward(config=config, samples=samples)) == [2.0, 4.0]


def test_custom_loss_passes_a_value_role_on_to_its_plugin(workdir):
    """slime's custom loss is the policy's: for the critic the adapter answers None, so pluggy's firstresult calls
    the algorithm plugin's loss (here a stand-in critic loss), while the actor gets the custom function."""
    from slimecore import hookimpl

    class ValueLoss:
        @hookimpl
        def slime_loss(self, config, role, batch, outputs, reducer):
            return "the plugin's value loss", {}

    config = Config.make(plugin_values={NAME: {"custom_loss_function_path": M + "custom_loss",
                                               "slime_sys_path": [str(workdir)]}})
    hooks = load_plugins([], extra=[ValueLoss()]).bind(config)
    assert hooks.plugin_name(hooks.answerer("slime_loss")) == NAME
    answer = hooks.slime_loss(config=config, role="critic", batch={}, outputs={}, reducer=None)
    assert answer == ("the plugin's value loss", {})


def test_args_have_slime_names_and_say_what_is_missing(tmp_path):
    (tmp_path / "c.yaml").write_text("my_threshold: 0.5\n")
    config = Config.make(plugins=["grpo"], rollout_batch_size=4, plugin_values={
        "grpo": {"eps_clip": 0.3, "disable_rewards_normalization": True},
        NAME: {"custom_config_path": str(tmp_path / "c.yaml"), "custom_loss_function_path": "m.f"}})
    args = make_args(config)
    assert (args.rollout_batch_size, args.eps_clip, args.my_threshold) == (4, 0.3, 0.5)
    assert args.rewards_normalization is False and args.loss_type == "custom_loss" and args.rollout_global_dataset
    assert make_args(config) is args  # state a function keeps on args persists
    assert getattr(args, "use_opd", "absent") == "absent"
    with pytest.raises(AttributeError, match="args.use_opd: slime's argument 'use_opd' has no value in slime-core"):
        args.use_opd
    assert slime_compat.load_function("os.path.join") is __import__("os").path.join
