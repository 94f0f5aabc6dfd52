"""The plugin with the real reasoning-gym package: discovery, start-up checks (before Ray), the data source
(problems at each task's level, prompts as the engine sees them, resumable), and the reward (the task's own
score_answer, fed to the difficulty controller)."""

import asyncio
import json

import pytest
import reasoning_gym
from click.testing import CliRunner

from slime_reasoning_gym import plugin
from slime_reasoning_gym.source import METADATA_KEY
from slime_reasoning_gym.tasks import Task, TaskError
from slimecore.config import ConfigError, parse_config
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.rollout.hook_args import buffer_filter
from slimecore.testing.contract import check_plugin_contract
from slimecore_cli.main import cli

HOOKS = ["slime_data_source", "slime_group_reward", "slime_log_rollout", "slime_options", "slime_quickstart_options",
         "slime_reward", "slime_validate_config"]


def _config(*argv):
    hooks = load_plugins(["grpo", "reasoning_gym"])
    config = parse_config(list(argv), ["grpo", "reasoning_gym"], hooks.slime_options(),
                          hooks.slime_implied_options(), hooks.slime_quickstart_options())
    hooks.slime_validate_config(config=config)
    return hooks, config


@pytest.fixture
def tokenizer(tiny_hf_checkpoint):
    from slimecore.hf_checkpoint import load_tokenizer

    return load_tokenizer(str(tiny_hf_checkpoint))


def _source(tokenizer, *argv):
    hooks, config = _config("--n-samples-per-prompt", "2", *argv)
    return hooks, config, hooks.slime_data_source(config=config, tokenizer=tokenizer,
                                                  buffer_filter=buffer_filter(hooks, config))


def test_discovered_with_its_hooks_and_quickstart():
    assert "reasoning_gym" in installed_entry_points()
    hooks = load_plugins(["reasoning_gym"])
    info = next(p for p in hooks.plugins if p.name == "reasoning_gym")
    assert info.hooks == HOOKS and info.distribution == "slime-core-reasoning-gym"
    assert check_plugin_contract("reasoning_gym") == HOOKS
    for hook in ("slime_data_source", "slime_reward"):
        assert hooks.plugin_name(hooks.answerer(hook)) == "reasoning_gym"
    _, config = _config()
    assert config.recommended_by == "plugin 'reasoning_gym'" and config.rollout_max_response_len == 32
    result = CliRunner().invoke(cli, ["plugins"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "slime-core-reasoning-gym" in line)
    assert "data_source, group_reward, log_rollout, options, quickstart_options, reward, validate_config" in row


@pytest.mark.parametrize("argv, message", [
    (["--rg-tasks", "basic_arithmetc"], "'basic_arithmetc' is not a reasoning-gym dataset \\(did you mean "
                                        "basic_arithmetic"),
    (["--rg-tasks", "leg_counting", "leg_counting"], "names a task twice"),
    (["--rg-task-config", '{"basic_arithmetic": {"num_termz": 3}}'], "\\['num_termz'\\] are not fields of "
                                                                     "BasicArithmeticDatasetConfig"),
    (["--rg-task-config", '{"leg_counting": {}}'], "names \\['leg_counting'\\], which are not in --rg-tasks"),
    (["--rg-task-config", '{"basic_arithmetic": {"min_digits": 0}}'], "reasoning-gym rejects the config"),
    (["--rg-task-config", '[1]'], "must be a JSON object of objects"),
    (["--rg-min-samples", "100"], "--rg-min-samples \\(100\\) <= --rg-window \\(64\\)"),
    (["--rg-raise-at", "0.1"], "--rg-lower-at \\(0.2\\) < --rg-raise-at \\(0.1\\)"),
    (["--rg-pass-score", "0"], "0 < --rg-pass-score <= 1"),
    (["--prompt-data", "x.jsonl", "--rollout-batch-size", "2"], "generates its prompts from --rg-tasks; drop --prompt-data"),
])
def test_bad_flags_are_start_up_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_the_cli_reports_them_before_ray_starts():
    result = CliRunner().invoke(cli, ["train", "--plugin", "grpo", "--plugin", "reasoning_gym", "--rg-tasks", "nope"])
    assert result.exit_code == 2 and "'nope' is not a reasoning-gym dataset" in result.output


def test_levels_are_the_curriculum_configs():
    task = Task("basic_arithmetic")
    assert task.top_level == 4  # num_terms has 5 levels, num_digits 4 (it stays at its top from level 3)
    low, high = task.config(0, 1, 100), task.config(4, 1, 100)
    assert (low["min_terms"], low["max_terms"], low["max_digits"]) == (2, 2, 1)
    assert (high["min_terms"], high["max_terms"], high["max_digits"]) == (2, 6, 4)  # inclusive: levels 0..4
    top_only = Task("basic_arithmetic", range_mode="upper_bound").config(4, 1, 100)
    assert (top_only["min_terms"], top_only["max_terms"]) == (6, 6)
    fixed = Task("basic_arithmetic", {"max_terms": 3, "operators": ["+"]}).config(4, 1, 100)
    assert fixed["max_terms"] == 3 and fixed["operators"] == ["+"]  # fixed fields win over the curriculum
    assert Task("gsm_symbolic").top_level == 0  # no curriculum: one level, its default config
    with pytest.raises(TaskError, match="level 5 is outside 0..4"):
        task.config(5, 1, 100)


def test_the_source_serves_problems_at_each_tasks_level(tokenizer):
    hooks, config, source = _source(tokenizer, "--rg-tasks", "basic_arithmetic", "leg_counting",
                                    "--rg-start-level", "2")
    groups = source.get_samples(6)
    assert len(groups) == 6 and all(len(g) == 2 for g in groups)
    tasks = set()
    for group in groups:
        a, b = group
        meta = a.metadata[METADATA_KEY]
        assert a.tokens == b.tokens and a.metadata == b.metadata and a.metadata is not b.metadata
        problem = reasoning_gym.create_dataset(meta["task"], **meta["config"])[meta["index"]]
        assert a.label == problem["answer"] and meta["level"] == 2
        assert problem["question"] in a.prompt and a.prompt.endswith("<|im_start|>assistant\n")  # chat template
        assert "<answer>" in a.prompt  # reasoning-gym's "direct" system prompt
        assert a.tokens == tokenizer(a.prompt, add_special_tokens=False).input_ids
        tasks.add(meta["task"])
    assert tasks == {"basic_arithmetic", "leg_counting"}
    # resume: a source restored from the state draws what the original draws next
    state = json.loads(json.dumps(source.state_dict()))
    _, _, resumed = _source(tokenizer, "--rg-tasks", "basic_arithmetic", "leg_counting", "--rg-start-level", "2")
    resumed.load_state_dict(state)
    assert [[s.tokens for s in g] for g in resumed.get_samples(3)] == [[s.tokens for s in g]
                                                                        for g in source.get_samples(3)]


def _score(config, sample, response):
    sample.response = response
    return asyncio.run(plugin.slime_reward(config, sample))


def test_the_reward_is_the_tasks_score_answer_and_moves_the_level(tokenizer):
    hooks, config, source = _source(tokenizer, "--rg-tasks", "basic_arithmetic", "--rg-min-samples", "4",
                                    "--rg-window", "4")
    samples = [s for g in source.get_samples(3) for s in g]
    right = [_score(config, s, f"The sum.\n<answer>{s.label}</answer>") for s in samples[:4]]
    assert right == [1.0] * 4
    assert _score(config, samples[4], f"{samples[4].label}") == 0.0  # no <answer> tag: reasoning-gym grades None
    assert _score(config, samples[5], "<answer>no idea</answer>") == 0.0
    metrics = {}
    hooks.slime_log_rollout(config=config, rollout_id=0, samples=samples, metrics=metrics)
    # 4 passes then 2 fails at level 0: the first 4 raised it to 1; results at level 0 after that are dropped
    assert metrics["reasoning_gym/basic_arithmetic/level"] == 1.0
    assert metrics["reasoning_gym/basic_arithmetic/level_changes"] == 1.0
    assert "reasoning_gym/basic_arithmetic/pass_rate" not in metrics  # nothing measured at level 1 yet
    next_group = source.get_samples(1)[0]
    assert next_group[0].metadata[METADATA_KEY]["level"] == 1


def test_the_whole_response_can_be_graded_and_other_samples_get_the_built_in_reward(tokenizer, make_sample):
    _, config, source = _source(tokenizer, "--rg-answer", "response", "--rg-system-prompt", "none")
    sample = source.get_samples(1)[0][0]
    assert "<answer>" not in sample.prompt
    assert _score(config, sample, f"  {sample.label}\n") == 1.0
    other = make_sample(label="37", metadata={"rm_type": "compare"})
    assert _score(config, other, "The larger is 37") == 1.0  # not a reasoning-gym problem: the reward hub
