"""slimecore.rollout.turns: parsing a tool call, running a sync or async tool, appending observations, and the turn
loop against the real embedded engine: tokens, loss mask and log-probs stay aligned across turns, observation
tokens are never trained, and the engine's log-probs of model tokens are what a plain forward pass gives."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from slimecore.ops.logprobs import per_sample_response_log_probs
from slimecore.rollout.client import RolloutClient
from slimecore.testing import mask_runs
from slimecore.rollout.turns import ToolCall, append_observation, parse_tag_call, run_tool, run_turns
from slimecore.types import Sample, Status


def test_parse_tag_call_takes_the_first_complete_call_across_lines():
    text = "<think>hm</think> <search>\n capital of\nFrance </search> then <answer>Paris</answer>"
    assert parse_tag_call(text, ("search", "answer")) == ToolCall("search", "capital of\nFrance")
    assert parse_tag_call("<answer> Paris </answer><search>x</search>", ("search", "answer")) == ToolCall("answer", "Paris")
    assert parse_tag_call("<search>x</answer>", ("search", "answer")) is None  # tags must match
    assert parse_tag_call("<search>x", ("search",)) is None
    assert parse_tag_call("<a.b>1</a.b>", ("a.b",)) == ToolCall("a.b", "1")  # names are literal, not regexes
    assert parse_tag_call("<axb>1</axb>", ("a.b",)) is None
    with pytest.raises(ValueError, match="at least one tag name"):
        parse_tag_call("<x>1</x>", ())


def test_run_tool_awaits_async_tools_and_runs_sync_ones_off_the_event_loop():
    loop_thread = {}

    def blocking(x):
        return (x * 2, threading.get_ident())

    async def non_blocking(x):
        return x + 1

    async def main():
        loop_thread["id"] = threading.get_ident()
        return await run_tool(blocking, 21), await run_tool(non_blocking, x=1)

    (doubled, thread), plus_one = asyncio.run(main())
    assert doubled == 42 and plus_one == 2
    assert thread != loop_thread["id"]  # a slow sync tool does not stall the other samples' generation


def test_append_observation_is_masked_and_respects_the_budget(tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    sample = Sample(tokens=[5, 6, 7])
    sample.append_response_tokens([8, 9], [-0.5, -0.25], finish_reason="stop")
    expected = tokenizer("\n<information>apple</information>\n", add_special_tokens=False)["input_ids"]
    assert append_observation(sample, "\n<information>apple</information>\n", tokenizer) == expected
    assert sample.response_tokens == [8, 9, *expected]
    assert sample.loss_mask == [1, 1] + [0] * len(expected)
    assert sample.rollout_log_probs == [-0.5, -0.25] + [0.0] * len(expected)
    assert sample.response.endswith("</information>\n") and sample.status == Status.COMPLETED
    before = (list(sample.tokens), sample.response_length)
    assert append_observation(sample, "more text", tokenizer, max_response_len=sample.response_length + 1) is None
    assert (sample.tokens, sample.response_length) == before  # a too-long observation changes nothing


def _model_logprobs(model, sample: Sample) -> torch.Tensor:
    """What the trainer computes: one unpadded forward over prompt + response, log-softmax at T = 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sample.tokens])).logits
    return per_sample_response_log_probs(logits, [sample.tokens], [sample.response_length])[0][0]


def test_turns_stay_aligned_and_match_a_forward_pass(embedded_engine):
    server = embedded_engine
    client = RolloutClient(server.url, tokenizer=server.tokenizer)
    observations = ["\n<information>apple river</information>\n", "\nnothing found\n"]
    seen = []

    async def on_turn(text, turn):
        seen.append((turn, text))
        return observations[turn]

    prompt = server.tokenizer("What is 3 + 4?", add_special_tokens=False)["input_ids"]
    sample = Sample(tokens=list(prompt))
    # sampled at T = 1 (seeded); turns end at a frequent stop character, so every turn ends by "stop"
    params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    client.run_sync(run_turns(sample, client, params, on_turn, max_turns=3, stop=(" ", "e", "a", "o", "i", "n")))
    sample.check_aligned()
    assert sample.metadata["turns"] == 3 and [t for t, _ in seen] == [0, 1]  # no tool after the last turn
    assert sample.status == Status.COMPLETED
    runs = mask_runs(sample.loss_mask)
    assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]  # model turns (trained) and observations (not)
    obs_tokens = [server.tokenizer(o, add_special_tokens=False)["input_ids"] for o in observations]
    response = sample.response_tokens
    for (value, start, end), expected in zip(runs[1::2], obs_tokens):
        assert value == 0 and response[start:end] == expected  # observations: exactly their tokens, never trained
        assert sample.rollout_log_probs[start:end] == [0.0] * len(expected)
    assert sample.response.startswith(seen[0][1] + observations[0] + seen[1][1] + observations[1])
    # the engine's log-probs of the model tokens equal a forward pass over the recorded tokens
    recomputed = _model_logprobs(server.model, sample)
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    engine = torch.tensor(sample.rollout_log_probs)
    assert (recomputed[mask] - engine[mask]).abs().max().item() < 1e-4


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _first_stop(server, prompt: list[int]) -> tuple[list[int], str, int]:
    """Greedy output of the prompt, a one-character stop string it contains, and the number of tokens
    after which that string first appears (where a turn with this stop ends)."""
    client = RolloutClient(server.url)
    out = client.run_sync(client.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 24}))
    ids = out["output_ids"]
    stop = next(ch for ch in server.tokenizer.decode(ids[2:]) if ch.isalnum())
    k = next(k for k in range(1, len(ids) + 1) if stop in server.tokenizer.decode(ids[:k]))
    return ids, stop, k


def test_stop_strings_end_a_turn_and_stay_in_its_tokens(embedded_engine):
    server = embedded_engine
    client = RolloutClient(server.url, tokenizer=server.tokenizer)
    prompt = server.tokenizer("apple river", add_special_tokens=False)["input_ids"]
    greedy, stop, k = _first_stop(server, prompt)
    texts = []

    def on_turn(text, turn):  # a sync callback works too
        texts.append(text)
        return None  # done: an answer

    sample = Sample(tokens=list(prompt))
    # a stop given as a string in the params is kept beside the ones run_turns adds
    client.run_sync(run_turns(sample, client, {**GREEDY, "max_new_tokens": 24, "stop": "#"}, on_turn, max_turns=3,
                              stop=(stop,)))
    assert sample.response_tokens == greedy[:k] and sample.status == Status.COMPLETED
    assert texts == [server.tokenizer.decode(greedy[:k])] and stop in texts[0]  # not trimmed
    assert sample.metadata["turns"] == 1 and sample.loss_mask == [1] * k


def test_the_response_budget_caps_turns_and_drops_an_observation_that_does_not_fit(embedded_engine):
    server = embedded_engine
    client = RolloutClient(server.url, tokenizer=server.tokenizer)
    prompt = server.tokenizer("apple river", add_special_tokens=False)["input_ids"]
    greedy, stop, k = _first_stop(server, prompt)
    params = {**GREEDY, "max_new_tokens": 24}

    def episode(budget, observation):
        sample, calls = Sample(tokens=list(prompt)), []
        client.run_sync(run_turns(sample, client, params, lambda text, turn: calls.append(turn) or observation,
                                  max_turns=3, stop=(stop,), max_response_len=budget))
        sample.check_aligned()
        return sample, calls

    sample, calls = episode(k - 1, "\n")  # the first turn gets only the tokens left: cut before its stop
    assert sample.response_tokens == greedy[:k - 1] and sample.status == Status.TRUNCATED and calls == []
    long = "apple river stone cloud tiger"
    sample, calls = episode(k + 2, long)  # the turn ends by its stop; the observation does not fit
    assert len(server.tokenizer(long, add_special_tokens=False)["input_ids"]) > 2
    assert sample.response_tokens == greedy[:k] and sample.status == Status.TRUNCATED and calls == [0]
    newline = len(server.tokenizer("\n", add_special_tokens=False)["input_ids"])
    sample, calls = episode(k + newline + 1, "\n")  # the observation fits; the next turn gets one token
    assert sample.response_length == k + newline + 1 and sample.loss_mask == [1] * k + [0] * newline + [1]
    assert sample.status == Status.TRUNCATED


def test_an_aborted_turn_ends_the_episode_at_once(embedded_engine):
    server = embedded_engine
    client = RolloutClient(server.url, tokenizer=server.tokenizer)
    calls = []

    def abort_when_running():
        for _ in range(6000):  # up to 30 s
            if server.loads()["num_running_reqs"]:
                break
            time.sleep(0.005)
        server.abort(abort_all=True)

    threading.Thread(target=abort_when_running, daemon=True).start()
    sample = Sample(tokens=[5, 6, 7])
    client.run_sync(run_turns(sample, client, {"max_new_tokens": 400, "ignore_eos": True},
                              lambda text, turn: calls.append(turn) or "\n", max_turns=3))
    assert sample.status == Status.ABORTED and calls == [] and sample.metadata["turns"] == 1
    sample.check_aligned()
    assert sample.loss_mask == [1] * sample.response_length and sample.response_length < 400


def test_run_turns_rejects_bad_input(embedded_engine):
    client = RolloutClient(embedded_engine.url, tokenizer=embedded_engine.tokenizer)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        client.run_sync(run_turns(Sample(tokens=[1]), client, {}, lambda t, n: None, max_turns=0))
    partial = Sample(tokens=[1, 2])
    partial.append_response_tokens([3], [-1.0])
    with pytest.raises(ValueError, match="already has 1 response tokens"):
        client.run_sync(run_turns(partial, client, {}, lambda t, n: None, max_turns=2))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        client.run_sync(run_turns(Sample(tokens=[1]), RolloutClient(embedded_engine.url), {}, lambda t, n: None,
                                  max_turns=2))
