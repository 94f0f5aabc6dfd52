"""search_r1's start-up checks (each bad flag is an error naming it, before Ray starts) and its data source:
the shipped QA set without --prompt-data, the built-in reading with it, labels checked when the source is built."""

import json

import pytest
from click.testing import CliRunner

from slime_search_r1.dataset import QA_PATH
from slimecore.config import ConfigError, parse_config
from slimecore.plugins import HookCallError, load_plugins
from slimecore.rollout.hook_args import buffer_filter
from slimecore_cli.main import cli


def _config(*argv):
    hooks = load_plugins(["grpo", "search_r1"])
    config = parse_config(["--rollout-batch-size", "2", *argv], ["grpo", "search_r1"], hooks.slime_options(),
                          hooks.slime_implied_options(), hooks.slime_quickstart_options())
    hooks.slime_validate_config(config=config)
    return hooks, config


@pytest.mark.parametrize("argv, message", [
    (["--max-turns", "0"], "--max-turns must be >= 1"),
    (["--search-topk", "0"], "--search-topk must be >= 1"),
    (["--search-timeout", "0"], "--search-timeout must be > 0"),
    (["--search-max-retries", "-1"], "--search-max-retries >= 0"),
    (["--search-url", "http://127.0.0.1:8000/retrieve", "--search-corpus", "c.jsonl"], "exclude each other"),
    (["--search-url", "127.0.0.1:8000/retrieve"], "is not an http\\(s\\) URL; give the full endpoint"),
    (["--search-corpus", "/no/such/corpus.jsonl"], "--search-corpus /no/such/corpus.jsonl: no such file"),
    (["--partial-rollout"], "--partial-rollout is not supported by plugin search_r1"),
    (["--prompt-data", "qa.jsonl"], "--label-key is not set"),
])
def test_bad_flags_are_start_up_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_the_cli_reports_them_before_ray_starts():
    result = CliRunner().invoke(cli, ["train", "--plugin", "grpo", "--plugin", "search_r1", "--partial-rollout",
                                      "--rollout-batch-size", "2"])
    assert result.exit_code == 2 and "--partial-rollout is not supported by plugin search_r1" in result.output


def test_without_prompt_data_the_shipped_questions_are_served(tiny_hf_checkpoint):
    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    hooks, config = _config("--n-samples-per-prompt", "2", "--apply-chat-template")
    source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
    assert len(source) == 95
    group = source.get_samples(1)[0]
    first = json.loads(QA_PATH.read_text().splitlines()[0])
    assert len(group) == 2 and group[0].label == first["label"] == {"target": ["Paris"]}
    assert group[0].prompt.startswith("<|im_start|>user\nAnswer the given question.")  # the chat template
    assert group[0].prompt.endswith("Question: What is the capital of France?\n<|im_end|>\n<|im_start|>assistant\n")
    assert group[0].tokens == tokenizer(group[0].prompt, add_special_tokens=False)["input_ids"]


def test_the_shipped_set_runs_with_its_own_quick_start_and_a_worked_example(tiny_hf_checkpoint):
    from slime_search_r1.dataset import ONE_SHOT_EXAMPLE, make_prompt
    from slime_search_r1.plugin import QUICKSTART
    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    hooks, config = _config()
    assert config.recommended_by == "plugin 'search_r1'"  # not the built-in compare task's 16 tokens per turn
    assert config.rollout_max_response_len == 64 and config.apply_chat_template is False
    assert config.recommended_applied == {k: v for k, v in QUICKSTART.items() if k != "rollout_batch_size"}
    source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
    prompt = source.get_samples(1)[0][0].prompt
    assert prompt == make_prompt("What is the capital of France", one_shot=True)  # plain text, no chat template
    assert ONE_SHOT_EXAMPLE + "Question: What is the capital of France?" in prompt
    hooks, config = _config("--search-prompt", "search_r1")
    source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
    prompt = source.get_samples(1)[0][0].prompt
    assert prompt == json.loads(QA_PATH.read_text().splitlines()[0])["input"]  # Search-R1's, word for word
    hooks, config = _config("--prompt-data", "qa.jsonl", "--label-key", "label")
    assert config.recommended_by is None and config.rollout_max_response_len != 64


def test_prompt_data_is_read_as_the_built_in_does_and_labels_are_checked(tiny_hf_checkpoint, tmp_path):
    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]}) + "\n"
                    + json.dumps({"question": "Who wrote Emma?", "answers": []}) + "\n")
    hooks, config = _config("--prompt-data", f"{data}@[0:1]", "--input-key", "question", "--label-key", "answers")
    source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
    assert len(source) == 1 and source.get_samples(1)[0][0].prompt == "Who wrote Hamlet?"
    hooks, config = _config("--prompt-data", str(data), "--input-key", "question", "--label-key", "answers")
    with pytest.raises(HookCallError, match=r"search_r1' raised in slime_data_source: .*qa.jsonl, prompt 2: its label "
                                            r"\[\] holds no golden answer"):
        hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
