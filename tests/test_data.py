"""Prompt files, the checkpointed data source, and the built-in data and reward plugins."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.data.dataset import DataError, parse_spec, read_rows, to_prompts
from slimecore.data.source import PromptDataSource, load_prompts, make_eval_source
from slimecore.data.tasks import TASKS
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.plugins import load_plugins
from slimecore.rollout.hook_args import buffer_filter
from slimecore.types import Sample


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _prompts(tokenizer, rows, **kw):
    args = dict(input_key="input", label_key=None, metadata_key="metadata", tool_key="tools",
                apply_chat_template=False) | kw
    return to_prompts(rows, tokenizer, **args)


# ---- files and slices -------------------------------------------------------------------------

@pytest.mark.parametrize("suffix,labels", [("", list(range(10))), ("@[2:5]", [2, 3, 4]), ("@[-2:]", [8, 9]),
                                           ("@[:3]", [0, 1, 2]), ("@[7:]", [7, 8, 9]), ("@[ 1 : -7 ]", [1, 2]),
                                           ("@[:]", list(range(10))), ("@[5:10]", [5, 6, 7, 8, 9])])
def test_jsonl_slices_follow_python(tmp_path, suffix, labels):
    spec = _jsonl(tmp_path / "d.jsonl", [{"input": f"q{i}", "label": i} for i in range(10)])
    rows = read_rows(spec + suffix)
    assert [r["label"] for _, r in rows] == labels
    assert rows[0][0] == f"{tmp_path / 'd.jsonl'}, line {labels[0] + 1}"


def test_parquet_rows_and_at_sign_in_path(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "user@host"
    folder.mkdir()
    pq.write_table(pa.table({"input": ["a", "b", "c"], "label": ["1", "2", "3"]}), folder / "d.parquet")
    rows = read_rows(str(folder / "d.parquet") + "@[1:]")
    assert [(where, r["input"]) for where, r in rows] == [(f"{folder / 'd.parquet'}, row 2", "b"),
                                                          (f"{folder / 'd.parquet'}, row 3", "c")]
    assert parse_spec(str(folder / "d.parquet")) == (folder / "d.parquet", slice(None))


@pytest.mark.parametrize("content,suffix,messages", [
    (['{"input": "a"}', '{"input": '], "", ["d.jsonl, line 2: invalid JSON", "one JSON object"]),
    (['{"input": "a"}', '', '[1, 2]'], "", ["d.jsonl, line 3: expected a JSON object, got a list"]),
    ([], "", ["d.jsonl has no rows", "point --prompt-data at another file"]),
    (["", "  "], "", ["has no rows"]),
    (['{"input": "a"}'], "@[x:y]", ["bad slice [x:y]", "path@[start:end]"]),
    (['{"input": "a"}'], "@[1:2:3]", ["bad slice"]),
    (['{"input": "a"}'], "@[1:2", ["bad slice; write path@[start:end]"]),
    (['{"input": "a"}'], "@[1:]", ["selects none of the 1 rows"]),
    (['{"input": "a"}'] * 20, "@[15:100]", ["slice reaches row 100 but", "has 20 rows", "@[15:]"]),
    (['{"input": "a"}'] * 3, "@[-5:]", ["slice reaches row -5"]),
    (['{"input": "a"}', '{"input": "caf\xe9"}'], "", ["d.jsonl, line 2: not UTF-8 (byte 0xe9 at column 15)"]),
])
def test_file_errors_name_the_file_line_and_fix(tmp_path, content, suffix, messages):
    path = tmp_path / "d.jsonl"
    path.write_bytes("\n".join(content).encode("latin-1"))
    with pytest.raises(DataError) as err:
        read_rows(str(path) + suffix)
    for message in messages:
        assert message in str(err.value)


def test_a_parquet_list_column_is_described(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [[1, 2, 3]], "label": ["1"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet, row 1: 'input' must be a string or a list of chat messages .* "
                                        r"got a list of 3 int values; point --input-key at the prompt text"):
        _prompts(tokenizer, read_rows(str(tmp_path / "d.parquet")))


def test_unknown_extension_missing_file_and_bad_parquet(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"d.csv: unknown extension '.csv'; use .jsonl .* or .parquet"):
        read_rows(str(tmp_path / "d.csv"))
    with pytest.raises(DataError, match="missing.jsonl does not exist .* check the path"):
        read_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot be read as parquet"):
        read_rows(str(tmp_path / "bad.parquet"))


# ---- rows to prompts --------------------------------------------------------------------------

def test_missing_keys_name_the_line_the_keys_and_the_flag(tmp_path, tokenizer):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [{"input": "ok"}, {"question": "a", "answer": 1}]))
    with pytest.raises(DataError) as err:
        _prompts(tokenizer, rows)
    assert "d.jsonl, line 2: no key 'input' (keys present: ['answer', 'question']); set --input-key" in str(err.value)
    with pytest.raises(DataError, match=r"line 1: no key 'label' \(keys present: \['input'\]\); set --label-key"):
        _prompts(tokenizer, rows[:1], label_key="label")


@pytest.mark.parametrize("row,message", [
    ({"input": "a", "metadata": "not json"}, "'metadata' is a string but not JSON"),
    ({"input": "a", "metadata": "[1]"}, "'metadata' must be a dict (or a JSON string of one), got a list of 1 int values"),
    ({"input": "a", "metadata": 3}, "'metadata' must be a dict"),
    ({"input": "a", "tools": {"name": "x"}}, "'tools' must be a list"),
    ({"input": 7}, "got an int; point --input-key at the prompt text"),
    ({"input": [{"role": "user", "content": "a"}]}, "list of chat messages; add --apply-chat-template"),
    ({"input": [{"role": "usr", "content": "a"}]}, "message 1 has role 'usr'; chat messages need a role among system"),
    ({"input": [{"role": "user"}]}, "message 1 (user) has no 'content'"),
    ({"input": []}, "must be a string or a list of chat messages"),
])
def test_bad_fields_are_reported(tmp_path, tokenizer, row, message):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [row]))
    with pytest.raises(DataError) as err:
        _prompts(tokenizer, rows)
    assert "d.jsonl, line 1: " in str(err.value) and message in str(err.value)


def test_labels_metadata_and_tools(tmp_path, tokenizer):
    tools = [{"type": "function", "function": {"name": "search"}}]
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [
        {"input": "a", "answer": [1, 2], "metadata": '{"rm_type": "repeat"}', "tools": json.dumps(tools)},
        {"input": "b", "answer": "x", "metadata": {"k": 1}},
        {"input": "c", "answer": None}]))
    records, filtered = _prompts(tokenizer, rows, label_key="answer")
    assert filtered == 0 and [r["label"] for r in records] == [[1, 2], "x", None]
    assert [r["metadata"] for r in records] == [{"rm_type": "repeat", "tools": tools}, {"k": 1}, {}]
    assert records[0]["prompt"] == "a" and records[0]["tokens"] == tokenizer("a", add_special_tokens=False).input_ids


def test_chat_template_strings_messages_and_kwargs(tmp_path, tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)  # own copy: this test changes its template
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [
        {"input": "hi"}, {"input": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}]))
    records, _ = _prompts(tokenizer, rows, apply_chat_template=True)
    assert records[0]["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert records[1]["prompt"] == ("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    assert records[1]["tokens"] == tokenizer(records[1]["prompt"], add_special_tokens=False).input_ids
    tokenizer.chat_template = "{{ greeting }} {{ messages[0]['content'] }}{% if add_generation_prompt %}!{% endif %}"
    records, _ = _prompts(tokenizer, rows[:1], apply_chat_template=True, chat_template_kwargs={"greeting": "yo"})
    assert records[0]["prompt"] == "yo hi!"
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="the tokenizer has no chat template; drop the flag"):
        _prompts(tokenizer, rows, apply_chat_template=True)


def test_prompt_length_filter_is_counted_logged_and_exposed(tmp_path, tokenizer, caplog):
    spec = _jsonl(tmp_path / "d.jsonl", [{"input": "hi"}, {"input": "word " * 200}, {"input": "yes"},
                                         {"input": "apple " * 100}])
    config = Config.make(prompt_data=spec, rollout_max_prompt_len=40, apply_chat_template=True, n_samples_per_prompt=1)
    with caplog.at_level(logging.WARNING, logger="slimecore.data"):
        source = PromptDataSource.from_config(config, tokenizer)
    assert source.num_filtered == 2 and len(source) == 2
    assert "dropped 2 of 4 prompts longer than --rollout-max-prompt-len 40" in caplog.text
    assert all(len(g[0].tokens) <= 40 for g in source.get_samples(2))
    with pytest.raises(ValueError, match="all 4 prompts are longer than --rollout-max-prompt-len 0 tokens; raise --rollout-max-prompt-len"):
        load_prompts(Config.make(prompt_data=spec, rollout_max_prompt_len=0), tokenizer, spec)


# ---- the data source --------------------------------------------------------------------------

def _source(tokenizer, n=3, shuffle=True, size=5, **kw):
    config = Config.make(n_samples_per_prompt=n, rollout_shuffle=shuffle, task_size=size, rollout_seed=7, **kw)
    return PromptDataSource.from_config(config, tokenizer)


def test_groups_indices_and_independent_copies(tokenizer):
    source = _source(tokenizer)
    groups = source.get_samples(7)  # 5 prompts per epoch: wraps into epoch 1
    assert [len(g) for g in groups] == [3] * 7 and len(source) == 5 and source.epoch == 1
    assert [s.index for g in groups for s in g] == list(range(21))
    assert [s.group_index for g in groups for s in g] == [i for i in range(7) for _ in range(3)]
    assert [s.index for g in source.get_samples(1) for s in g] == [21, 22, 23]
    first = groups[0]
    assert len({s.prompt for s in first}) == 1 and first[0].tokens == tokenizer(first[0].prompt,
                                                                               add_special_tokens=False).input_ids
    assert first[0].label and first[0].metadata == {"rm_type": "compare"}
    first[0].metadata["seen"] = True
    first[0].tokens.append(1)
    assert "seen" not in first[1].metadata and len(first[1].tokens) == len(first[0].tokens) - 1
    assert "seen" not in source.records[source._order[0]]["metadata"]


def test_epochs_reshuffle_with_seed_plus_epoch(tokenizer):
    source = _source(tokenizer, n=1, size=6)
    prompts = [g[0].prompt for g in source.get_samples(18)]
    for epoch in range(3):
        order = list(range(6))
        random.Random(7 + epoch).shuffle(order)
        assert prompts[6 * epoch: 6 * epoch + 6] == [source.records[i]["prompt"] for i in order]
    assert prompts[:6] != prompts[6:12]
    plain = _source(tokenizer, n=1, size=6, shuffle=False)
    assert [g[0].prompt for g in plain.get_samples(12)] == [r["prompt"] for r in plain.records] * 2


def test_buffer_first_then_fresh_and_custom_filter(tokenizer):
    source = _source(tokenizer, n=2)
    old = source.get_samples(3)
    source.add_samples(old)
    got = source.get_samples(2)
    assert [g[0].group_index for g in got] == [0, 1] and len(source.buffer) == 1
    got = source.get_samples(3)
    assert [g[0].group_index for g in got] == [2, 3, 4]  # the rest of the buffer, then fresh prompts

    def newest_first(buffer, num_groups):
        return [buffer.pop() for _ in range(min(num_groups, len(buffer)))]

    source = PromptDataSource(source.records, 2, buffer_filter=newest_first)
    source.add_samples(source.get_samples(3))
    assert [g[0].group_index for g in source.get_samples(2)] == [2, 1]
    source.buffer_filter = lambda buffer, num_groups: list(buffer) * 2
    with pytest.raises(ValueError, match="returned 2 groups for a request of 1; a slime_buffer_filter must return"):
        source.get_samples(1)


def test_state_round_trip_gives_the_same_next_prompts_and_keeps_the_buffer(tokenizer):
    source = _source(tokenizer)
    source.get_samples(3)
    partial = source.get_samples(1)[0]
    partial[0].append_response_tokens([5, 6], [-0.1, -0.2], finish_reason="abort")
    partial[0].metadata["start_rollout_id"] = 4
    source.add_samples([partial])
    state = json.loads(json.dumps(source.state_dict()))  # survives serialisation
    assert {"epoch_id", "sample_offset", "sample_group_index", "sample_index", "buffer"} <= set(state)
    expected = source.get_samples(8)  # crosses into epochs 1 and 2 (reshuffled)
    resumed = _source(tokenizer)
    resumed.load_state_dict(state)
    got = resumed.get_samples(8)
    assert [[s.to_dict() for s in g] for g in got] == [[s.to_dict() for s in g] for g in expected]
    assert got[0][0].response_length == 2 and got[0][0].rollout_log_probs == [-0.1, -0.2]
    assert got[0][0].status is Sample.Status.ABORTED and got[0][0].metadata["start_rollout_id"] == 4


def test_resume_on_a_different_prompt_count_warns(tokenizer, caplog):
    source = _source(tokenizer, size=5)
    source.get_samples(5)
    resumed = _source(tokenizer, size=3)
    with caplog.at_level(logging.WARNING, logger="slimecore.data"):
        resumed.load_state_dict(source.state_dict())
    assert "resuming with 3 prompts where the checkpoint had 5" in caplog.text
    assert [g[0].group_index for g in resumed.get_samples(1)] == [5] and resumed.epoch == 1


def test_prompt_file_and_task_specs(tmp_path, tokenizer):
    spec = _jsonl(tmp_path / "d.jsonl", [{"q": f"question {i}", "a": str(i)} for i in range(6)])
    config = Config.make(prompt_data=spec + "@[1:4]", input_key="q", label_key="a", n_samples_per_prompt=2)
    source = PromptDataSource.from_config(config, tokenizer)
    assert [(g[0].prompt, g[1].label) for g in source.get_samples(3)] == [(f"question {i}", str(i)) for i in (1, 2, 3)]
    records, _ = load_prompts(Config.make(task_size=4), tokenizer, "task:repeat")
    assert [r["label"] for r in records] == [row["label"] for row in TASKS["repeat"].make_rows(4, 42)]
    assert records[0]["prompt"].startswith("<|im_start|>user\nRepeat this word")  # tasks use the chat template
    with pytest.raises(ValueError, match="unknown built-in task 'nope'"):
        load_prompts(Config.make(), tokenizer, "task:nope")


def test_eval_source_uses_its_own_seed(tokenizer):
    config = Config.make(n_samples_per_eval_prompt=2, task_size=64)
    ev = make_eval_source(config, tokenizer, "task:compare")
    groups = ev.get_samples(len(ev))
    assert len(groups) == 64 and all(len(g) == 2 for g in groups)
    train = [r["prompt"] for r in load_prompts(config, tokenizer, None)[0]]
    assert [g[0].prompt for g in groups] != train


# ---- the built-in plugins ---------------------------------------------------------------------

def test_default_data_plugin_asks_the_buffer_filter_hook(tokenizer):
    class NewestFirst:
        @hookimpl
        def slime_buffer_filter(self, buffer, num_groups):
            return [buffer.pop() for _ in range(min(num_groups, len(buffer)))]

    config = Config.make(task_size=4, n_samples_per_prompt=2)
    for extra, expected in (((), [0, 1]), ((NewestFirst(),), [1, 0])):
        hooks = load_plugins([], extra=extra)
        source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
        assert isinstance(source, PromptDataSource) and len(source) == 4
        source.add_samples(source.get_samples(2))
        assert [g[0].group_index for g in source.get_samples(2)] == expected


def test_builtin_reward_dispatch_and_errors():
    hooks = load_plugins([])

    def reward(sample, **config):
        return asyncio.run(hooks.slime_reward(config=Config.make(**config), sample=sample))

    assert reward(Sample(response="42", label="42", metadata={"rm_type": "compare"})) == 1.0
    assert reward(Sample(response="apple", label="apple"), rm_type="repeat") == 1.0
    # the sample's own rm_type wins over --rm-type
    assert reward(Sample(response="The answer is 7", label="7", metadata={"rm_type": "arithmetic"}),
                  rm_type="repeat") == 1.0
    with pytest.raises(Exception) as err:
        reward(Sample(response="x", metadata={"rm_type": "nope"}))
    assert "no built-in reward 'nope'" in str(err.value) and "arithmetic, compare" in str(err.value)
    assert "--plugin ./my_reward.py" in str(err.value) and "slime_reward" in str(err.value)
    with pytest.raises(Exception, match="no 'rm_type' and --rm-type is not set"):
        reward(Sample(index=3, response="x"))
