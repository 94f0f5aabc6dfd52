"""SFT's settings: the core options it implies (``slime_implied_options``: no engines, one copy of each
conversation) and the start-up error for every flag that contradicts them or has no effect in SFT."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slimecore import hookimpl
from slimecore.config import Config, ConfigError, apply_implied_options, parse_config
from slimecore.plugins import PluginError, load_plugins
from slimecore.testing import timeout as scaled


def _parse(*argv: str, plugins=("sft",)) -> Config:
    hooks = load_plugins(list(plugins))
    config = parse_config(list(argv), list(plugins), hooks.slime_options(), hooks.slime_implied_options())
    hooks.slime_validate_config(config=config)
    return config


def test_sft_runs_without_engines_and_with_one_copy_of_each_conversation():
    config = _parse("--task", "compare")
    assert config.without_engines and not config.engines and config.n_samples_per_prompt == 1
    # the task's quick-start batch stays, its 8 samples per prompt do not: one optimizer step takes 8 conversations
    assert config.rollout_batch_size == 8 and config.global_batch_size == 8
    assert "n_samples_per_prompt" not in config.recommended_applied and config.recommended_applied["lr"] == 1e-5
    assert _parse("--no-engines", "--n-samples-per-prompt", "1").without_engines  # the same values, said again
    assert _parse("--debug-train-only").without_engines  # slime's flag for the same mode


@pytest.mark.parametrize("argv,expected", [
    (["--n-samples-per-prompt", "4"], "plugin 'sft' runs only with --n-samples-per-prompt 1, but the command line or "
                                      "--config gives --n-samples-per-prompt 4"),
    (["--engines"], "plugin 'sft' runs only with --no-engines, but the command line or --config gives --engines"),
    (["--rollout-temperature", "0.7"], "--rollout-temperature 0.7 with --plugin sft"),
    (["--eval-prompt-data", "cmp", "task:compare"], "--eval-prompt-data has no effect with --plugin sft"),
    (["--over-sampling-batch-size", "16"], "--over-sampling-batch-size has no effect"),
    (["--partial-rollout"], "--partial-rollout has no effect"),
    (["--mask-offpolicy-in-partial-rollout"], "--mask-offpolicy-in-partial-rollout has no effect"),
    (["--group-rm"], "--group-rm has no effect"),
    (["--rm-type", "compare"], "--rm-type has no effect"),
    (["--rollout-max-prompt-len", "64"], "--rollout-max-prompt-len has no effect .* --sft-max-len truncates"),
    (["--sft-max-len", "1"], "--sft-max-len must be >= 2"),
    (["--prompt-data", "{data}"], "--rollout-batch-size is required with --plugin sft"),
    (["--prompt-data", "{data}", "--rollout-batch-size", "2"], r"chats\.jsonl, line 1: no key 'input' .* "
                                                               "--input-key messages"),
    (["--prompt-data", "{data}", "--rollout-batch-size", "2", "--input-key", "messages", "--label-key", "answer"],
     r"chats\.jsonl, line 1: no key 'answer'"),
])
def test_contrary_or_pointless_flags_are_start_up_errors_naming_them(tmp_path, argv, expected):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    with pytest.raises(ConfigError, match=expected):
        _parse(*[a.format(data=data) for a in argv])


def test_implied_options_of_two_plugins_must_agree_and_name_core_options():
    config = Config.make()
    with pytest.raises(ConfigError, match="plugin 'other' runs only with --n-samples-per-prompt 4, but plugin 'sft' "
                                          "implies --n-samples-per-prompt 1"):
        apply_implied_options(config, {"sft": {"n_samples_per_prompt": 1}, "other": {"n_samples_per_prompt": 4}},
                              set())
    with pytest.raises(ConfigError, match=r"plugin 'sft': slime_implied_options names 'engine', which is not "
                                          r"a core option \(did you mean 'engines'\?\)"):
        apply_implied_options(config, {"sft": {"engine": False}}, set())


def test_an_implied_options_answer_that_is_not_a_dict_is_an_error_naming_the_plugin():
    class ListAnswer:
        @hookimpl
        def slime_implied_options(self):
            return ["engines"]

    hooks = load_plugins([], extra=[ListAnswer()], defaults=False)
    with pytest.raises(PluginError, match="plugin 'ListAnswer': slime_implied_options must return a dict"):
        hooks.slime_implied_options()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *args], capture_output=True, text=True,
                          timeout=scaled(120))


def test_the_command_line_stops_before_ray_at_a_bad_row_or_a_second_algorithm(tmp_path):
    data = tmp_path / "chats.jsonl"
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    bad = good[:1]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, bad)))
    proc = _cli("--plugin", "sft", "--prompt-data", str(data), "--input-key", "messages", "--rollout-batch-size", "2")
    assert proc.returncode == 2 and "chats.jsonl, line 2: no assistant message to train on" in proc.stderr
    assert "Ray" not in proc.stderr + proc.stdout
    proc = _cli("--plugin", "sft", "--plugin", "grpo")
    assert proc.returncode == 2 and "plugins 'grpo', 'sft' all implement" in proc.stderr.replace("\n", " ")


def test_the_plugin_meets_the_hook_contract():
    from slimecore.testing.contract import check_plugin_contract

    assert check_plugin_contract("sft") == [
        "slime_compute_advantages", "slime_data_source", "slime_implied_options", "slime_loss", "slime_options",
        "slime_rollout", "slime_train_inputs", "slime_validate_config"]
