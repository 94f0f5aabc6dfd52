"""Agent sessions on the tiny model: the official ``openai`` and ``anthropic`` SDKs against the session endpoints
(chat, tools, several turns, streaming), recorded tokens equal to the engine's output ids, the trainer's
log-probs equal to the engine's, a rewritten history forking into samples that share a ``rollout_id`` (and
GRPO grouping them as one rollout), each API's error shapes, and the ``slime_agent`` hook through the built-in
generate (reward, failure, timeout)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
import torch

from agent_toolmodel import ANSWER, ANTHROPIC_TOOLS as TAUGHT_ANTHROPIC_TOOLS, OPENAI_TOOLS as TAUGHT_TOOLS
from agent_toolmodel import question
from slimecore import hookimpl
from slimecore.agents.chat import ChatTemplate, hermes_messages, parse_qwen_tool_calls, tool_parser
from slimecore.agents.episode import stop_session_server
from slimecore.config import Config
from slimecore.plugins import load_plugins
from slimecore.rollout.client import RolloutClient
from slimecore.rollout.hook_args import SampleHooks
from slimecore.rollout.manager import convert_samples
from slimecore.rollout.schedule import build_dp_schedule
from slimecore.types import Sample, Status

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "a+b",
                    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def always_add(text: str):
    """A tool parser (``--agent-tool-parser module:function``) that reads every turn as a call of ``add``: the random
    tiny model never writes a well-formed call, and the tool-call round trip must still be exercised."""
    return text.strip(), [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]


@pytest.fixture
def calls_add(agent_sessions):
    agent_sessions.server.tool_parser = always_add
    yield
    agent_sessions.server.tool_parser = parse_qwen_tool_calls


def _engine_output(url: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    client = RolloutClient(url)
    out = client.run_sync(client.generate(prompt_ids, {"max_new_tokens": max_new_tokens, "temperature": 0.0}))
    return out["output_ids"]


def _check_exact(sample: Sample, turns, engine_url: str, max_new_tokens: int) -> None:
    """One linear episode: the sample is the last turn's prompt + output, each turn's prompt extends the previous
    turn's tokens exactly, mask 1 covers exactly the model's output ids, and those are what the engine generates
    from that prompt (greedy, asked again)."""
    assert len(turns) >= 2 and all(t.parent == t.index - 1 for t in turns[1:])
    assert sample.tokens == turns[-1].prompt_ids + turns[-1].output_ids
    start = len(turns[0].prompt_ids)
    for prev, turn in zip(turns, turns[1:]):
        assert turn.prompt_ids[:len(prev.end_ids)] == prev.end_ids  # never re-tokenised
    trained = [sample.tokens[start + i] for i, m in enumerate(sample.loss_mask) if m]
    assert trained == [t for turn in turns for t in turn.output_ids]
    for turn in turns:
        assert turn.output_ids == _engine_output(engine_url, turn.prompt_ids, max_new_tokens)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m == 0)


def test_openai_sdk_chat_tools_turns_and_streaming(agent_sessions, tiny_engine, calls_add):
    session = agent_sessions.open(max_new_tokens=6, temperature=0.0)
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 1 + 2?"}]
    first = client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS, max_tokens=6)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1} and call.id.startswith("call_")
    assert first.usage.completion_tokens == 6 and first.model == session.model
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    agent_sessions.server.tool_parser = parse_qwen_tool_calls
    chunks = list(client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    third = client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS, max_tokens=6, n=2)
    assert len(third.choices) == 2  # n > 1: two answers, two branches of the session
    turns = list(session.state.trajectory.turns)
    samples = agent_sessions.finish(session)
    assert len(samples) == 2 and samples[0].rollout_id == samples[1].rollout_id
    prompt = agent_sessions.tokenizer.decode(turns[0].prompt_ids)
    assert "<tools>" in prompt and '"add"' in prompt  # the tools reached the prompt (Hermes form: no tools in template)
    assert "<tool_response>\n3\n</tool_response>" in agent_sessions.tokenizer.decode(turns[1].prompt_ids)
    _check_exact(samples[0], turns[:3], tiny_engine.url, 6)
    assert sum(samples[1].loss_mask) == len(turns[3].output_ids)  # the shared turns are trained once


def test_anthropic_sdk_chat_tools_turns_and_streaming(agent_sessions, tiny_engine, calls_add):
    session = agent_sessions.open(max_new_tokens=6, temperature=0.0)
    client = anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    first = client.messages.create(model=session.model, max_tokens=6, system="Use tools.", messages=messages,
                                   tools=ANTHROPIC_TOOLS)
    use = [b for b in first.content if b.type == "tool_use"][0]
    assert first.stop_reason == "tool_use" and use.name == "add" and use.input == {"a": 1}
    assert use.id.startswith("toolu_") and first.usage.output_tokens == 6
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
    agent_sessions.server.tool_parser = parse_qwen_tool_calls
    with client.messages.stream(model=session.model, max_tokens=6, system="Use tools.", messages=messages,
                                tools=ANTHROPIC_TOOLS) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        second = stream.get_final_message()
    assert second.stop_reason == "max_tokens" and "".join(deltas) == second.content[0].text
    messages += [{"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "Thanks."}]
    third = client.messages.create(model=session.model, max_tokens=6, system="Use tools.", messages=messages,
                                   tools=ANTHROPIC_TOOLS, stop_sequences=["zzz"])
    assert third.content[0].type == "text"
    turns = list(session.state.trajectory.turns)
    [sample] = agent_sessions.finish(session)
    _check_exact(sample, turns, tiny_engine.url, 6)


def test_a_model_that_calls_tools_through_both_sdks(tool_checkpoint):
    """Tool calls the engine itself writes, read by the qwen parser, round-tripped by each SDK."""
    from slimecore.testing.engines import embedded_engine
    from slimecore.testing.sessions import agent_sessions as serve_sessions

    with embedded_engine(tool_checkpoint) as engine, serve_sessions(engine.url, tool_checkpoint) as sessions:
        session = sessions.open(max_new_tokens=96, temperature=0.0)
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": question(30)}]
        reply = client.chat.completions.create(model=session.model, messages=messages, tools=TAUGHT_TOOLS)
        [call] = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        final = client.chat.completions.create(model=session.model, messages=messages, tools=TAUGHT_TOOLS)
        assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
        turns = list(session.state.trajectory.turns)
        [sample] = sessions.finish(session)
        _check_exact(sample, turns, engine.url, 96)

        session = sessions.open(max_new_tokens=96, temperature=0.0)
        client = anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": question(64)}]
        reply = client.messages.create(model=session.model, max_tokens=96, messages=messages,
                                       tools=TAUGHT_ANTHROPIC_TOOLS)
        [use] = reply.content
        assert reply.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"a": 1, "b": 2}
        messages += [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
        final = client.messages.create(model=session.model, max_tokens=96, messages=messages,
                                       tools=TAUGHT_ANTHROPIC_TOOLS)
        assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
        [sample] = sessions.finish(session)
        model_tokens = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if m]
        assert model_tokens.count(sessions.tokenizer.eos_token_id) == 2  # both model turns end on their own EOS


def test_trainer_log_probs_equal_the_engines_on_session_samples(agent_sessions, tiny_hf_checkpoint):
    from slimecore.trainers.trainer import Trainer

    samples = []
    for index in range(2):
        session = agent_sessions.open(Sample(index=index, group_index=0), max_new_tokens=8, temperature=1.0)
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Which number is larger: 3 or 8?"}]
        reply = client.chat.completions.create(model=session.model, messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model=session.model, messages=messages)
        samples += agent_sessions.finish(session)
    for sample in samples:
        sample.reward = 1.0
    config = Config.make(rollout_batch_size=1, n_samples_per_prompt=2, hf_checkpoint=str(tiny_hf_checkpoint))
    data = convert_samples(load_plugins([]), config, samples)
    data["steps"] = [{"micro_batches": [list(range(len(samples)))]}]
    recomputed = Trainer(config, load_plugins([]), rank=0, world_size=1).compute_log_probs(data)
    for sample, log_probs in zip(samples, recomputed):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert mask.sum() > 0 and mask.sum() < len(mask)  # model tokens trained, template and user tokens not
        diff = (log_probs[mask] - torch.tensor(sample.rollout_log_probs)[mask]).abs().max().item()
        assert diff < 1e-4, diff


def test_a_rewritten_history_forks_and_grpo_keeps_the_rollout_together(agent_sessions):
    session = agent_sessions.open(Sample(index=7, group_index=3), max_new_tokens=4)
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    history = [{"role": "user", "content": "Count to three."}]
    first = client.chat.completions.create(model="m", messages=history)
    history += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="m", messages=history)
    # context compaction: the client replaces its history by a summary; nothing recorded is a prefix of it
    client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Summary: counting."},
                                                        {"role": "user", "content": "Go on."}])
    turns = list(session.state.trajectory.turns)
    assert [t.parent for t in turns] == [None, 0, None]
    forked = agent_sessions.finish(session)
    assert len(forked) == 2 and {s.rollout_id for s in forked} == {7} and {s.group_index for s in forked} == {3}
    assert forked[0].tokens == turns[1].end_ids and forked[1].tokens == turns[2].end_ids
    assert all(s.metadata["session_samples"] == 2 for s in forked)

    other = Sample(index=8, group_index=3, rollout_id=8, tokens=[1, 2], response_length=1, loss_mask=[1],
                   rollout_log_probs=[-1.0], status=Status.COMPLETED)
    for sample, reward in zip([*forked, other], [1.0, 1.0, 0.0]):
        sample.reward = reward
    hooks = load_plugins(["grpo"])
    values = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    config = Config.make(plugin_values={"grpo": values}, n_samples_per_prompt=2, rollout_batch_size=1,
                         global_batch_size=1)
    data = convert_samples(hooks, config, [*forked, other])
    # two rollouts in the group: the forked one counts once, so the advantages are +-1/sqrt(2), not skewed by 2:1
    assert data["rewards"] == pytest.approx([2 ** -0.5, 2 ** -0.5, -(2 ** -0.5)], abs=1e-5)
    assert data["rollout_ids"] == [7, 7, 8]
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], 1, 1, micro_batch_size=1)
    assert [sorted(step.samples) for step in schedule.steps] == [[0, 1], [2]]  # siblings train in one step


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_each_api_answers_errors_in_its_own_shape(agent_sessions, api):
    session = agent_sessions.open(max_new_tokens=2)
    if api == "openai":
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        call = client.chat.completions.create
        cases = [
            (openai.BadRequestError, "messages[0].role", dict(messages=[{"role": "robot", "content": "x"}])),
            (openai.BadRequestError, "tools[0].function.parameters",
             dict(messages=[{"role": "user", "content": "x"}],
                  tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])),
            (openai.BadRequestError, "function.arguments",
             dict(messages=[{"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}])),
        ]
        for error, param, kwargs in cases:
            with pytest.raises(error) as caught:
                call(model="m", **kwargs)
            assert caught.value.status_code == 400 and param in caught.value.body["param"]
            assert caught.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=session.base_url, api_key="slime-unknown", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}])
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    else:
        client = anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0)
        cases = [dict(messages=[{"role": "system", "content": "x"}]),
                 dict(messages=[{"role": "user", "content": [  # a result for a call nobody made
                     {"type": "tool_result", "tool_use_id": "toolu_never_called", "content": "3"}]}]),
                 dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                 dict(messages=[{"role": "user", "content": "x"}], tools=[{"name": "f"}]),
                 dict(messages=[{"role": "user", "content": "x"}],
                      tools=[{"name": "f", "input_schema": {"type": "array"}}])]
        for kwargs in cases:
            with pytest.raises(anthropic.BadRequestError) as caught:
                client.messages.create(model="m", max_tokens=2, **kwargs)
            assert caught.value.status_code == 400 and caught.value.body["type"] == "error"
            assert caught.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=session.anthropic_base_url, api_key="slime-unknown",
                                max_retries=0).messages.create(model="m", max_tokens=2,
                                                               messages=[{"role": "user", "content": "x"}])
        assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
    agent_sessions.finish(session)


def test_the_context_window_is_checked_as_sglang_does(agent_sessions, tiny_engine):
    """The tiny model's context is 512 tokens (the engine's /v1/models says so, as SGLang's does). A max_tokens
    that does not fit beside the prompt is SGLang's 400 on both APIs; without max_tokens the turn generates up to
    the context (past the session's larger cap) and reports length."""
    import re
    import urllib.request

    card = json.loads(urllib.request.urlopen(tiny_engine.url + "/v1/models", timeout=30).read())["data"][0]
    assert card["max_model_len"] == 512 and card["owned_by"] == "sglang"
    session = agent_sessions.open(max_new_tokens=4096, ignore_eos=True, temperature=0.0)
    long = [{"role": "user", "content": " ".join(["seven"] * 120)}]
    said = re.compile(r"Requested token count exceeds the model's maximum context length of 512 tokens\. You requested "
                      r"a total of (\d+) tokens: (\d+) tokens from the input messages and 100 tokens for the "
                      r"completion\. Please reduce the number of tokens in the input messages or the completion to "
                      r"fit within the limit\.")
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=session.model, messages=long, max_tokens=100)
    found = said.fullmatch(caught.value.body["message"])
    assert caught.value.status_code == 400 and found and int(found[1]) == int(found[2]) + 100 > 512
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic.Anthropic(base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
                            ).messages.create(model=session.model, messages=long, max_tokens=100)
    assert caught.value.status_code == 400 and caught.value.body["error"]["type"] == "invalid_request_error"
    assert said.fullmatch(caught.value.body["error"]["message"])
    answer = client.chat.completions.create(model=session.model, messages=long)  # no max_tokens
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 512
    assert len(session.state.trajectory.turns) == 1  # the refused requests generated nothing
    agent_sessions.finish(session)


def test_a_request_without_model_is_refused_by_both_apis(agent_sessions):
    import urllib.error
    import urllib.request

    session = agent_sessions.open(max_new_tokens=2)
    for path, body, error in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
             {"message": "you must provide a model parameter", "type": "invalid_request_error", "param": "model"}),
            ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
             {"type": "invalid_request_error", "message": "model: Field required"})]:
        request = urllib.request.Request(agent_sessions.url + path, json.dumps(body).encode(), {
            "Content-Type": "application/json", "Authorization": f"Bearer {session.api_key}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        answer = json.loads(caught.value.read())
        assert caught.value.code == 400 and error.items() <= answer["error"].items(), answer
    assert session.state.trajectory.turns == []  # nothing was generated
    agent_sessions.finish(session)


def test_session_id_from_header_or_body_and_closed_sessions(agent_sessions):
    import urllib.error
    import urllib.request

    session = agent_sessions.open(max_new_tokens=2)

    def post(body, headers):
        request = urllib.request.Request(agent_sessions.url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert post(body, {"X-Session-Id": session.id})[0] == 200
    assert post({**body, "session_id": session.id}, {})[0] == 200
    assert post(body, {})[0] == 401
    assert len(session.state.trajectory.turns) == 2
    agent_sessions.finish(session)
    status, answer = post(body, {"Authorization": f"Bearer {session.api_key}"})
    assert status == 401 and "closed" in answer["error"]["message"]


def test_tool_call_parsing_and_templates_that_read_tools(tiny_hf_checkpoint):
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert parse_qwen_tool_calls(text) == ("Let me add.", [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 1}}}])
    assert parse_qwen_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')[1][0][
        "function"]["arguments"] == {"x": 2}
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_qwen_tool_calls(broken) == (broken, [])
    assert tool_parser("test_agents:always_add")("x")[1][0]["function"]["name"] == "add"
    with pytest.raises(ValueError, match="unknown"):
        tool_parser("nope")
    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
                {"role": "tool", "tool_call_id": "c", "content": "2"}, {"role": "tool", "tool_call_id": "d",
                                                                           "content": "5"}]
    plain = hermes_messages(messages, TOOLS)
    assert plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in plain[2]["content"]
    assert plain[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>\n<tool_response>\n5\n"
                                                   "</tool_response>"}
    # a template that reads tools gets them as they are
    tokenizer.chat_template = ("{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{% endif %}"
                               "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    template = ChatTemplate(tokenizer)
    assert template.reads_tools and template.render(messages[:1], TOOLS, True).startswith("[add]<|im_start|>user")
    assert template.closing_ids == tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert template.glue([5, template.closing_ids[0]]) == template.closing_ids[1:]
    assert template._compiled is not None and template._backend is not None  # the fast paths were taken


@pytest.mark.parametrize("tools_template", [False, True])
def test_the_fast_render_and_encode_equal_apply_chat_template(tiny_hf_checkpoint, monkeypatch, tools_template):
    """The session layer's compiled-template rendering and backend tokenising give exactly what
    ``apply_chat_template`` / ``tokenizer(...)`` give, and a transformers without the internal it uses falls
    back to them."""
    import sys
    import types

    import transformers.utils.chat_template_utils as ctu

    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    if tools_template:
        tokenizer.chat_template = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>"
                                   "{{ m['role'] }}\n{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
                                   "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                                   "assistant\n{% endif %}")
    chats = [[{"role": "system", "content": "Tu es bref. <|im_end|> 数学"}, {"role": "user", "content": "1+1 ?\n\n"}],
             [{"role": "user", "content": "add"}, {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": [2]}}}]},
              {"role": "tool", "tool_call_id": "c", "content": "3"}, {"role": "assistant", "content": " ok "}]]
    fast, slow = ChatTemplate(tokenizer), None
    without = types.ModuleType(ctu.__name__)  # that module as a transformers without the internal would have it
    without.__dict__.update({k: v for k, v in vars(ctu).items() if k != "_compile_jinja_template"})
    monkeypatch.setitem(sys.modules, ctu.__name__, without)
    slow = ChatTemplate(tokenizer)
    assert fast._compiled is not None and fast._backend is not None and slow._compiled is None
    for chat in chats:
        for tools in (None, TOOLS):
            for generation in (True, False):
                text = fast.render(chat, tools, generation)
                assert text == slow.render(chat, tools, generation)
                assert fast.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert fast.closing_ids == slow.closing_ids


class InProcessAgent:
    """A slime_agent that plays with the OpenAI SDK in the rollout's own event loop."""

    def __init__(self, mode: str = "ok"):
        self.mode = mode

    @hookimpl
    async def slime_agent(self, config, sample, session):
        if self.mode == "silent":
            return None
        client = session.openai_client()
        reply = await client.chat.completions.create(model=session.model, messages=[
            {"role": "user", "content": str(sample.prompt)}], temperature=0.3)
        assert reply.choices[0].message.role == "assistant"
        if self.mode == "raise":
            raise RuntimeError("the agent crashed")
        if self.mode == "slow":
            await asyncio.sleep(30)
        return 0.25 if self.mode == "ok" else None


@pytest.mark.parametrize("mode", ["ok", "none", "raise", "slow", "silent"])
def test_slime_agent_through_the_built_in_generate(tiny_engine, tiny_hf_checkpoint, mode):
    from slimecore.rollout.groups import sampling_params
    from slimecore.hf_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_hf_checkpoint))
    hooks = load_plugins([], extra=[InProcessAgent(mode)])
    config = Config.make(rollout_batch_size=1, rollout_max_response_len=4, hf_checkpoint=str(tiny_hf_checkpoint),
                         agent_timeout=3.0)
    client = RolloutClient(tiny_engine.url, tokenizer=tokenizer)
    sample = Sample(index=5, group_index=2, prompt="Which number is larger: 3 or 8?", tokens=[1, 2])

    async def go():
        try:
            return await SampleHooks(hooks).generate(config=config, sample=sample,
                                                     sampling_params=sampling_params(config), client=client,
                                                     evaluation=False)
        finally:
            await client.close()

    try:
        [out] = asyncio.run(go())
    finally:
        stop_session_server()
    assert out is sample and out.session_id.startswith("slime-")
    if mode in ("ok", "none"):
        assert out.status == Status.TRUNCATED and out.rollout_id == 5 and sum(out.loss_mask) == 4
        assert out.reward == (0.25 if mode == "ok" else None)
        assert out.metadata["agent_ignored_sampling"] == 1  # temperature 0.3 asked; the run's 1.0 is pinned
    else:
        assert out.status == Status.FAILED and out.remove_sample and out.reward == 0.0
        assert {"raise": "crashed", "slow": "--agent-timeout", "silent": "without a model call"}[mode] in \
            out.metadata["agent_error"]


def test_the_routers_manual_policy_keeps_a_session_on_one_engine(engines):
    """Agent runs start the router with --policy manual; the session id goes as X-SMG-Routing-Key."""
    from slimecore.engines.router import Router

    servers, _ = engines
    router = Router([s.url for s in servers], policy="manual").start()
    client = RolloutClient(router.url)

    async def served_by(key: str) -> int:
        before = [s.stats["waves"] for s in servers]
        await client.generate([1, 2, 3], {"max_new_tokens": 1}, routing_key=key)
        return [a - b for a, b in zip([s.stats["waves"] for s in servers], before)].index(1)

    async def go():
        try:
            context = await client.max_model_len()  # the router answers /v1/models without it: asked of a worker
            return context, {key: [await served_by(key) for _ in range(3)] for key in ("s1", "s2", "s3", "s4", "s5")}
        finally:
            await client.close()

    try:
        context, engines_by_key = asyncio.run(go())
    finally:
        router.stop()
    assert context == servers[0].context_len
    assert all(len(set(used)) == 1 for used in engines_by_key.values()), engines_by_key
