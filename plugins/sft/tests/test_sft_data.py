"""SFT data: jsonl/parquet conversations and the built-in task, bad rows named by file and line, the data
source's samples (tokens, response, mask, status), tool schemas reaching the template, truncation."""

from __future__ import annotations

import json

import pytest

from slimecore.config import Config
from slimecore.data.dataset import DataError
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.types import Status
from slime_sft.data import SFTDataSource, read_conversations, stop_token_ids

GOOD = {"messages": [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]}


def _config(checkpoint=None, **kw):
    return Config.make(plugins=["sft"], hf_checkpoint=str(checkpoint) if checkpoint else None, rollout_batch_size=2,
                       **kw)


def _write(tmp_path, rows, name="chats.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad,expected", [
    ({"conversation": GOOD["messages"]}, r"no key 'messages' \(keys present: \['conversation'\]\); set --input-key"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to train on"),
    ({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "message 0 has role 'bot'"),
    ({"messages": "not json"}, "'messages' is a string but not JSON"),
    ('{"messages": [', "invalid JSON"),
])
def test_bad_rows_are_errors_naming_the_file_and_line(tmp_path, bad, expected):
    path = _write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(DataError, match=rf"^{path}, line 3: .*{expected}"):
        read_conversations(_config(prompt_data=str(path), input_key="messages"))


def test_the_built_in_task_becomes_question_and_correct_answer():
    conversations = read_conversations(_config(task="compare", task_size=5))
    assert len(conversations) == 5 and conversations[0].where == "task:compare, row 1"
    user, assistant = conversations[0].messages
    assert user["role"] == "user" and "Which number is larger" in user["content"]
    assert assistant == {"role": "assistant", "content": conversations[0].label}
    a, b = (int(n) for n in user["content"].split(": ")[1].split("?")[0].split(" or "))
    assert int(conversations[0].label) == max(a, b)


def test_data_source_serves_complete_samples_one_conversation_per_group(tiny_hf_checkpoint):
    tok = load_tokenizer(tiny_hf_checkpoint)
    source = SFTDataSource.load(_config(tiny_hf_checkpoint, task="compare", task_size=6), tok)
    assert len(source) == 6
    groups = source.get_samples(4)
    assert [len(g) for g in groups] == [1, 1, 1, 1]
    for [sample] in groups:
        sample.check_aligned()
        assert sample.status == Status.COMPLETED and sample.reward == 0.0 and sample.response_length > 0
        assert tok.decode(sample.response_tokens) == f"{sample.label}<|im_end|>\n"
        assert sample.loss_mask == [1] * (sample.response_length - 1) + [0]  # "\n" after <|im_end|> is glue
        assert sample.prompt[-1] == {"role": "assistant", "content": sample.label}
    assert [s.index for [s] in groups] == [0, 1, 2, 3]
    state = source.state_dict()
    assert state["sample_offset"] == 4 and state["epoch_id"] == 0


def test_tools_reach_the_chat_template_and_parquet_json_strings_are_read(tmp_path, tiny_hf_checkpoint):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = load_tokenizer(tiny_hf_checkpoint)
    tok.chat_template = ("{% if tools %}<|im_start|>system\n{{ tools | length }} tool: {{ tools[0]['name'] }}"
                         "<|im_end|>\n{% endif %}" + tok.chat_template)
    tools = [{"name": "search", "parameters": {}}]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(GOOD["messages"])], "tools": [json.dumps(tools)]}), path)
    config = _config(tiny_hf_checkpoint, prompt_data=str(path), input_key="messages")
    [[sample]] = SFTDataSource.load(config, tok).get_samples(1)
    assert tok.decode(sample.tokens).startswith("<|im_start|>system\n1 tool: search<|im_end|>\n")
    assert sample.metadata["tools"] == tools and tok.decode(sample.response_tokens) == "7<|im_end|>\n"


def test_sft_max_len_truncates_and_drops_conversations_left_without_trained_tokens(tmp_path, tiny_hf_checkpoint):
    tok = load_tokenizer(tiny_hf_checkpoint)
    long_answer = {"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "apple river stone cloud tiger music green"}]}
    long_question = {"messages": [{"role": "user", "content": "apple river stone cloud tiger music green " * 4},
                                  {"role": "assistant", "content": "yes"}]}
    path = _write(tmp_path, [long_answer, long_question])
    config = _config(tiny_hf_checkpoint, prompt_data=str(path), input_key="messages")
    source = SFTDataSource.load(config, tok, max_len=16)
    assert len(source) == 1 and source.num_filtered == 1  # the long question leaves no answer token within 16
    [[sample]] = source.get_samples(1)
    assert len(sample.tokens) == 16 and sample.status == Status.TRUNCATED and all(sample.loss_mask)
    assert tok.decode(sample.response_tokens) in "apple river stone cloud tiger music green"
    with pytest.raises(DataError, match="every conversation .* loses all its assistant tokens to --sft-max-len 4"):
        SFTDataSource.load(config, tok, max_len=4)


def test_stop_tokens_are_the_models_eos_ids(tiny_hf_checkpoint):
    tok = load_tokenizer(tiny_hf_checkpoint)
    assert stop_token_ids(str(tiny_hf_checkpoint), tok) == {tok.convert_tokens_to_ids("<|im_end|>")}


def test_a_resumed_source_continues_with_the_same_conversations(tiny_hf_checkpoint):
    tok = load_tokenizer(tiny_hf_checkpoint)
    config = _config(tiny_hf_checkpoint, task="compare", task_size=5, rollout_shuffle=True)
    source = SFTDataSource.load(config, tok)
    source.get_samples(3)
    state = json.loads(json.dumps(source.state_dict()))  # as a checkpoint stores it
    expected = [(s.tokens, s.loss_mask) for [s] in source.get_samples(4)]  # crosses into the next, reshuffled epoch
    resumed = SFTDataSource.load(config, tok)
    resumed.load_state_dict(state)
    assert [(s.tokens, s.loss_mask) for [s] in resumed.get_samples(4)] == expected
