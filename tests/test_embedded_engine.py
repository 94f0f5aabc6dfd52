"""The embedded engine over real HTTP with the tiny model: SGLang's response shapes, finish reasons,
log-probs against an unpadded forward, batching and joining, abort, pause, weight updates, Ray."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch
from fixtures_engine import http_json

from slimecore.engines.embedded import EmbeddedServer
from slimecore.rollout.client import RolloutClient
from slimecore.testing import timeout as scaled

LONG = {"max_new_tokens": 400, "ignore_eos": True}


def generate(server, input_ids=(5, 6, 7), return_logprob=True, **params):
    status, out = http_json("POST", server.url + "/generate", {"input_ids": list(input_ids), "sampling_params": params,
                                                               "return_logprob": return_logprob})
    assert status == 200, out
    return out


def unpadded_logprobs(model, prompt, output, temperature=1.0):
    """What the trainer computes: log_softmax(logits / T) of one unpadded forward of prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output)])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def assert_logprobs_match(server, prompt, out, temperature=1.0):
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and all(e[2] is None for e in entries)
    assert out["meta_info"]["output_token_logprobs_length"] == len(entries)
    expected = unpadded_logprobs(server.model, prompt, out["output_ids"], temperature)
    assert (expected - torch.tensor([e[0] for e in entries])).abs().max().item() < 1e-4


def wait_for(condition, timeout=scaled(30)):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.005)


def in_background(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) on a thread; returns a dict with the 'thread' and, once done, the 'value'."""
    box = {}

    def run():
        box["value"] = fn(*args, **kwargs)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    box["thread"] = thread
    return box


def test_health_is_503_while_loading_then_info_endpoints(tiny_checkpoint):
    release = threading.Event()

    class SlowLoad(EmbeddedServer):
        def _load_model(self):
            release.wait(30)
            super()._load_model()

    server = SlowLoad(str(tiny_checkpoint), model_path_for_info="tiny/qwen2")
    started = in_background(server.start)
    try:
        wait_for(lambda: server.port != 0)
        assert http_json("GET", server.url + "/health")[0] == 503
        release.set()
        started["thread"].join(30)
        assert http_json("GET", server.url + "/health") == (200, None)
        assert http_json("GET", server.url + "/health_generate") == (200, None)
        for path in ("/model_info", "/get_model_info"):
            info = http_json("GET", server.url + path)[1]
            assert info["model_path"] == "tiny/qwen2" and info["tokenizer_path"] == str(tiny_checkpoint)
            assert info["is_generation"] is True and info["architectures"] == ["Qwen2ForCausalLM"]
            assert info["weight_version"] == "default" and info["preferred_sampling_params"] is None
        for path in ("/server_info", "/get_server_info"):
            info = http_json("GET", server.url + path)[1]
            assert {k: info[k] for k in ("tp_size", "dp_size", "pp_size", "ep_size", "disaggregation_mode")} == \
                {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "disaggregation_mode": "null"}
            assert info["weight_version"] == "default" and info["version"] and info["dtype"] == "float32"
        for path in ("/get_weight_version", "/weight_version"):
            assert http_json("GET", server.url + path) == (200, {"weight_version": "default"})
    finally:
        release.set()
        server.stop()


def test_length_finish_shapes_and_logprob_values(embedded_engine):
    server = embedded_engine
    out = generate(server, max_new_tokens=6, ignore_eos=True, temperature=0.7, top_k=5)
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6 == len(out["output_ids"]) and meta["prompt_tokens"] == 3
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert meta["reasoning_tokens"] == 0  # SGLang sends it always: 0 unless require_reasoning on a thinking model
    assert meta["input_token_logprobs"] == [] and len(meta["id"]) == 32
    # full-vocabulary log_softmax(logits / T): no renormalisation over the top-k kept tokens
    assert_logprobs_match(server, [5, 6, 7], out, temperature=0.7)
    greedy = generate(server, max_new_tokens=5, ignore_eos=True, temperature=0)
    assert_logprobs_match(server, [5, 6, 7], greedy, temperature=1.0)  # greedy reports T = 1
    assert generate(server, max_new_tokens=5, ignore_eos=True, temperature=0)["output_ids"] == greedy["output_ids"]
    empty = generate(server, max_new_tokens=0)
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert generate(server, return_logprob=False, max_new_tokens=2).keys() == out.keys()


def test_prompt_logprobs_from_logprob_start_len(embedded_engine):
    server, prompt = embedded_engine, [5, 6, 7, 8, 9]
    status, out = http_json("POST", server.url + "/generate", {
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
    entries = out["meta_info"]["input_token_logprobs"]
    assert status == 200 and [e[1] for e in entries] == prompt[1:] and entries[0][0] is None
    expected = unpadded_logprobs(server.model, prompt[:2], prompt[2:])
    assert (expected - torch.tensor([e[0] for e in entries[1:]])).abs().max().item() < 1e-4


def test_stop_token_ids_and_eos(embedded_engine):
    server = embedded_engine
    every = list(range(server.model.config.vocab_size))
    out = generate(server, max_new_tokens=10, stop_token_ids=every)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][0]}
    assert len(out["output_ids"]) == 1 == len(out["meta_info"]["output_token_logprobs"])  # stop token included
    kept = generate(server, max_new_tokens=10, stop_token_ids=every, no_stop_trim=True, skip_special_tokens=False)
    assert out["text"] == "" and kept["text"] == server.tokenizer.decode(kept["output_ids"])
    # ignore_eos turns off every token stop, stop_token_ids included
    assert generate(server, max_new_tokens=3, stop_token_ids=every, ignore_eos=True)["meta_info"]["finish_reason"] \
        == {"type": "length", "length": 3}
    # min_new_tokens bans the stop tokens until it is reached: only token 0 is left to draw
    banned = generate(server, max_new_tokens=10, stop_token_ids=every[1:], min_new_tokens=4, temperature=0)
    assert banned["output_ids"][:4] == [0] * 4 and len(banned["output_ids"]) >= 5
    assert server.tokenizer.convert_tokens_to_ids("<|im_end|>") in server.eos_ids


def test_stop_string_keeps_tokens_and_trims_text(embedded_engine):
    server, tok = embedded_engine, embedded_engine.tokenizer
    ids = generate(server, max_new_tokens=40, ignore_eos=True, temperature=0)["output_ids"]
    texts = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # the first token (after the first) that adds plain ASCII text not seen before: stop on that text
    k = next((k for k in range(1, len(ids)) if (piece := texts[k + 1][len(texts[k]):].strip()).isascii()
              and piece.isalnum() and piece not in texts[k]), None)
    if k is None:
        pytest.skip("the random model produced no plain-text token to stop on")
    piece = texts[k + 1][len(texts[k]):].strip()
    for no_stop_trim in (False, True):
        out = generate(server, max_new_tokens=40, ignore_eos=True, temperature=0, stop=piece, no_stop_trim=no_stop_trim)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
        assert out["output_ids"] == ids[:k + 1]  # the tokens completing the stop string are kept
        assert out["text"] == (texts[k + 1] if no_stop_trim else texts[k + 1][:texts[k + 1].find(piece)])


@pytest.mark.parametrize("params, words", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 2}, "min_new_tokens"), ({"bogus": 1}, "bogus"),
    ({"temperature": "hot"}, "temperature"), ({"n": 2}, "n > 1"), ({"regex": "a+"}, "regex"),
    ({"repetition_penalty": 0}, "repetition_penalty")])
def test_invalid_sampling_params_get_400(embedded_engine, params, words):
    status, body = http_json("POST", embedded_engine.url + "/generate",
                             {"input_ids": [1, 2], "sampling_params": params})
    assert status == 400 and words in body["error"]["message"]


def test_reasoning_tokens_count_to_the_end_of_thinking(embedded_engine, monkeypatch):
    server = embedded_engine
    greedy = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}
    ids = generate(server, **greedy)["output_ids"]
    monkeypatch.setattr(server, "think_end_id", ids[2])  # as if the third token were the model's </think>
    body = {"input_ids": [5, 6, 7], "sampling_params": greedy, "require_reasoning": True}
    status, out = http_json("POST", server.url + "/generate", body)
    assert status == 200 and out["output_ids"] == ids
    assert out["meta_info"]["reasoning_tokens"] == ids.index(ids[2]) + 1
    assert http_json("POST", server.url + "/generate", {**body, "require_reasoning": False})[1]["meta_info"][
        "reasoning_tokens"] == 0


def test_a_body_that_is_not_utf8_gets_400(embedded_engine):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(embedded_engine.url + "/generate", b'{"text": "caf\xe9"}',
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400
    assert "not UTF-8 (byte 0xe9 at offset 13)" in caught.value.read().decode()


def test_invalid_bodies_get_400_and_router_fields_are_ignored(embedded_engine):
    url = embedded_engine.url
    vocab = embedded_engine.model.config.vocab_size
    for body in ({}, {"input_ids": []}, {"input_ids": [vocab]}, {"input_ids": list(range(5)) * 200}, [{"input_ids": [1]}],
                 {"text": []}, {"input_ids": [[1], [vocab]]}, {"input_ids": [[1], [2]], "rid": "one"},
                 {"input_ids": [[1], [2]], "sampling_params": [{}]}, {"input_ids": [[1], [2]], "rid": ["a", "a"]}):
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 400 and answer["error"]["message"], body
    extra = {"model": None, "log_metrics": True, "return_text_in_logprobs": False, "stream": False,
             "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
             "return_entropy": False, "data_parallel_rank": 0, "my_custom_field": 1}
    status, out = http_json("POST", url + "/generate", {"text": "What is 2 + 2?", "sampling_params": {
        "max_new_tokens": 2, "stop": None, "stop_token_ids": None, "top_k": None}, **extra})
    assert status == 200
    assert out["meta_info"]["prompt_tokens"] == len(embedded_engine.tokenizer("What is 2 + 2?").input_ids)
    for path, field in (("/update_weights_from_tensor", "serialized_named_tensors"),
                        ("/init_weights_update_group", "master_address"), ("/update_weights_from_distributed", "names")):
        status, body = http_json("POST", url + path, {})
        assert status == 400 and body["success"] is False and field in body["message"]
    assert http_json("POST", url + "/release_memory_occupation", {"tags": ["bogus"]})[0] == 400
    assert http_json("GET", url + "/v1/loads?include=bogus")[0] == 400


def test_a_batch_request_answers_each_prompt_as_its_own_request_would(embedded_engine):
    """SGLang's batch form: a list of prompts, per-prompt or shared fields, a list of answers in order."""
    url, greedy = embedded_engine.url, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13]]
    alone = [generate(embedded_engine, p, **greedy) for p in prompts]
    calls = embedded_engine.stats["generate_calls"]
    status, answers = http_json("POST", url + "/generate", {"input_ids": prompts, "sampling_params": greedy,
                                                            "return_logprob": [True, False, True],
                                                            "rid": ["r0", "r1", "r2"]})
    assert status == 200 and isinstance(answers, list) and len(answers) == 3, answers
    assert embedded_engine.stats["generate_calls"] == calls + 1
    for one, answer, rid in zip(alone, answers, ["r0", "r1", "r2"]):
        assert answer["output_ids"] == one["output_ids"] and answer["meta_info"]["id"] == rid
    assert "output_token_logprobs" not in answers[1]["meta_info"]
    assert [e[0] for e in answers[2]["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in alone[2]["meta_info"]["output_token_logprobs"]], abs=1e-5)
    params = [dict(greedy, max_new_tokens=1), dict(greedy, max_new_tokens=4)]
    status, answers = http_json("POST", url + "/generate", {"text": ["What is 2 + 2?", "Hi"], "sampling_params": params})
    assert status == 200 and [a["meta_info"]["completion_tokens"] for a in answers] == [1, 4]
    status, answer = http_json("POST", url + "/generate", {"input_ids": [[1], [2, 3]], "sampling_params": {"n": 2}})
    assert status == 400 and answer["error"]["message"].startswith("batch entry 0: n > 1"), answer


def test_concurrent_requests_share_a_wave_and_match_unpadded_forwards(embedded_engine):
    server = embedded_engine
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [3, 4]]  # different lengths: left padding is exercised
    waves = server.stats["waves"]

    async def batch():
        client = RolloutClient(server.url)
        try:
            return await asyncio.gather(*(client.generate(p, {"max_new_tokens": 6 + 3 * i, "ignore_eos": True})
                                          for i, p in enumerate(prompts)))
        finally:
            await client.close()

    outs = asyncio.run(batch())
    assert server.stats["waves"] == waves + 1  # one batch served them all (prefilled together or joined)
    assert http_json("GET", server.url + "/server_info")[1]["internal_states"][0]["waves"] == waves + 1
    for prompt, out in zip(prompts, outs):
        assert_logprobs_match(server, prompt, out)  # rows that left early did not disturb the others


def test_greedy_batch_equals_model_generate(embedded_engine):
    """A greedy wave of prompts of different lengths gives model.generate's tokens on the same left-padded
    batch, row for row (benchmarks/engine_decode.py times this same comparison)."""
    server = embedded_engine
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [3, 4]]
    reqs = [server.submit(server.new_request({"input_ids": p, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})) for p in prompts]
    for req in reqs:
        assert req.done.wait(scaled(60))
    width = max(map(len, prompts))
    ids = torch.tensor([[server.pad_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    config = copy.deepcopy(server.model.generation_config)
    config.eos_token_id = None  # no stop token: generation never ends early, as with ignore_eos
    with torch.inference_mode():
        expected = server.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                         max_new_tokens=12, do_sample=False,
                                         pad_token_id=server.pad_id)[:, width:].tolist()
    assert [r.output_ids for r in reqs] == expected


def test_shared_prompt_prefix_is_prefilled_once_and_changes_no_value(embedded_engine, monkeypatch):
    """Prompts with a common prefix (a chat template, the n samples of one prompt) prefill it once; rows
    that leave early and rows that join later keep the values of unpadded forwards (the KV buffers grow
    in place and are re-adopted after rows are dropped or padded)."""
    server = embedded_engine
    shared_calls = []
    prefill_shared = server._prefill_shared
    monkeypatch.setattr(server, "_prefill_shared", lambda reqs, n: shared_calls.append(n) or prefill_shared(reqs, n))
    prefix = list(range(20, 32))
    prompts = [prefix + [5, 6, 7], prefix + [9], prefix + [10, 11, 12, 13], prefix]
    reqs = [server.submit(server.new_request({"input_ids": p, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 4 + 5 * i, "ignore_eos": True}})) for i, p in enumerate(prompts)]
    wait_for(lambda: shared_calls)
    late = [server.submit(server.new_request({"input_ids": prefix + s, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 70, "ignore_eos": True}})) for s in ([40], [41, 42])]  # past a chunk
    for req in reqs + late:
        assert req.done.wait(scaled(60))
    assert shared_calls[0] == len(prefix) - 1  # the shortest prompt keeps one token of its own
    for req in reqs + late:
        assert req.finish_reason["type"] == "length" and len(req.output_ids) == req.params["max_new_tokens"]
        out = {"output_ids": req.output_ids,
               "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)],
                             "output_token_logprobs_length": len(req.output_ids)}}
        assert_logprobs_match(server, req.input_ids, out)


@pytest.mark.parametrize("seeded", [False, True])
def test_draw_follows_the_row_probabilities(seeded):
    """The engine's sampler: each row's frequencies match its (unnormalised) weights; weight 0 never comes; the
    same with the counter-based numbers of seeded rows (one seed, successive positions)."""
    from slimecore.engines.embedded import _draw, _seeded_uniform

    weights = torch.tensor([[0.2, 0.0, 1.2, 0.6], [0.0, 0.0, 0.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    n = 60_000
    uniform = (torch.tensor([[_seeded_uniform(7, p)] for p in range(3 * n)]) if seeded
               else torch.rand(3 * n, 1, generator=torch.Generator().manual_seed(3)))
    tokens = _draw(weights.repeat(n, 1), uniform).view(n, 3)
    for row in range(3):
        freq = torch.bincount(tokens[:, row], minlength=4).double() / n
        expected = weights[row].double() / weights[row].sum()
        assert (freq - expected).abs().max() < 0.01  # ~5 standard errors at n = 60k
        assert freq[expected == 0].sum() == 0
    # a point that rounds up to the row's total still lands on a token of positive probability
    assert _draw(torch.tensor([[0.5, 0.5, 0.0, 0.0]]), torch.ones(1, 1)).tolist() == [1]


def test_seeded_rows_draw_alike_in_any_batch_and_order(embedded_engine):
    """A seeded request's tokens depend on its seed only: alone, or in a batch with other rows in another order."""
    seeded = {"max_new_tokens": 6, "ignore_eos": True}
    alone = [generate(embedded_engine, sampling_seed=seed, **seeded)["output_ids"] for seed in (5, 6)]
    status, batch = http_json("POST", embedded_engine.url + "/generate", {
        "input_ids": [[5, 6, 7]] * 3,
        "sampling_params": [{**seeded, "sampling_seed": 6}, seeded, {**seeded, "sampling_seed": 5}]})
    assert status == 200 and [batch[0]["output_ids"], batch[2]["output_ids"]] == [alone[1], alone[0]]
    assert alone[0] != alone[1]


def test_identical_prompts_are_prefilled_once_and_decode_as_their_own_rows(embedded_engine, monkeypatch):
    """The n samples of one prompt: the prefill forward sees each distinct prompt once, and every sample
    keeps the values of its own unpadded forward (its row is a copy, then decodes on its own)."""
    server = embedded_engine
    prefilled = []
    prefill = server._prefill
    monkeypatch.setattr(server, "_prefill", lambda reqs: prefilled.append(len(reqs)) or prefill(reqs))
    prompts = [[5, 6, 7]] * 3 + [[9, 10]] * 2 + [[11]]
    server.unpaused.clear()  # hold them all, so they start as one wave
    reqs = [server.submit(server.new_request({"input_ids": p, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 3 + 2 * i, "ignore_eos": True}})) for i, p in enumerate(prompts)]
    server.unpaused.set()
    for req in reqs:
        assert req.done.wait(scaled(60))
    assert prefilled == [6, 3]  # the wave, then its three distinct prompts
    for req in reqs:
        assert len(req.output_ids) == req.params["max_new_tokens"]
        out = {"output_ids": req.output_ids,
               "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)],
                             "output_token_logprobs_length": len(req.output_ids)}}
        assert_logprobs_match(server, req.input_ids, out)
    assert reqs[0].output_ids == reqs[1].output_ids[:3] == reqs[2].output_ids[:3]  # greedy: the same tokens


def test_late_request_joins_the_running_batch(embedded_engine):
    server = embedded_engine
    waves, joined = server.stats["waves"], server.stats["joined"]
    long = in_background(generate, server, (5, 6, 7), True, **LONG)
    wait_for(lambda: server.loads()["num_running_reqs"] == 1)
    short = generate(server, (8, 9, 10, 11), max_new_tokens=5, ignore_eos=True)
    assert "value" not in long  # answered while the long request still decodes
    assert_logprobs_match(server, [8, 9, 10, 11], short)  # joined with a left-padded cache: same values
    long["thread"].join(60)
    assert_logprobs_match(server, [5, 6, 7], long["value"])
    assert server.stats["waves"] == waves + 1 and server.stats["joined"] == joined + 1


def test_abort_by_rid_prefix_and_in_the_waiting_queue(embedded_engine):
    server = embedded_engine  # max_batch_size 8
    rids = ["job-1", "job-10", "other"] + [f"fill-{i}" for i in range(6)]  # 9 requests: one must wait
    calls = [in_background(lambda rid=rid: http_json("POST", server.url + "/generate", {
        "rid": rid, "input_ids": [5, 6], "sampling_params": LONG, "return_logprob": True})[1]) for rid in rids]
    wait_for(lambda: server.loads() == {"num_running_reqs": 8, "num_waiting_reqs": 1})
    status, body = http_json("POST", server.url + "/generate", {"rid": "other", "input_ids": [1]})
    assert status == 400 and "Duplicate request ID" in body["error"]["message"]
    assert http_json("POST", server.url + "/abort_request", {"rid": "nothing-like-it"}) == (200, None)
    assert http_json("POST", server.url + "/abort_request", {"rid": "job-1"}) == (200, None)
    for call in calls[:2]:  # job-1 and job-10: the rid is a prefix
        call["thread"].join(30)
        meta = call["value"]["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert len(meta["output_token_logprobs"]) == len(call["value"]["output_ids"]) > 0
    assert "value" not in calls[2]
    status, load = http_json("GET", server.url + "/get_load")
    assert load[0]["num_reqs"] >= 7 and load[0]["dp_rank"] == 0
    assert http_json("GET", server.url + "/flush_cache")[0] == 400  # busy
    assert http_json("POST", server.url + "/abort_request", {"abort_all": True}) == (200, None)
    outs = [c["thread"].join(30) or c["value"] for c in calls[2:]]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    waited = [o for o in outs if o["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"]
    assert len(waited) <= 1 and all("prompt_tokens" not in o["meta_info"] for o in waited)
    loads = http_json("GET", server.url + "/v1/loads?include=core")[1]
    assert set(loads) == {"timestamp", "version", "loads"}
    assert loads["loads"][0]["num_running_reqs"] == 0 == loads["loads"][0]["num_waiting_reqs"]
    assert http_json("POST", server.url + "/flush_cache")[0] == 200


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(embedded_engine):
    server = embedded_engine
    running = in_background(generate, server, (5, 6), True, **LONG)
    wait_for(lambda: server.loads()["num_running_reqs"] == 1)
    assert http_json("POST", server.url + "/pause_generation", {}) == (
        200, {"message": "Generation paused successfully.", "status": "ok"})
    assert "value" in running or running["thread"].join(5) is None
    assert running["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    held = in_background(generate, server, (5, 6), True, max_new_tokens=2)
    time.sleep(0.3)
    assert "value" not in held
    # held requests are outside the scheduler: the engine is idle, so the cache flushes
    assert http_json("GET", server.url + "/v1/loads")[1]["loads"][0]["num_waiting_reqs"] == 0
    assert http_json("GET", server.url + "/flush_cache")[0] == 200
    assert http_json("POST", server.url + "/continue_generation", {}) == (
        200, {"message": "Generation continued successfully.", "status": "ok"})
    held["thread"].join(30)
    assert len(held["value"]["output_ids"]) >= 1


def test_update_weights_from_disk_waits_for_requests_and_changes_outputs(embedded_engine, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    server = embedded_engine
    old_model = AutoModelForCausalLM.from_pretrained(server.model_path)
    original = {k: v.clone() for k, v in server.model.state_dict().items()}
    save_file({k: v * 1.5 for k, v in original.items()}, str(tmp_path / "model.safetensors"))
    before = generate(server, max_new_tokens=3, temperature=0)
    try:
        running = in_background(generate, server, (5, 6), True, **LONG)
        wait_for(lambda: server.loads()["num_running_reqs"] == 1)
        status, body = http_json("POST", server.url + "/update_weights_from_disk",
                                 {"model_path": str(tmp_path), "weight_version": "3"})
        assert status == 200 and body == {"success": True, "num_paused_requests": 0,
                                          "message": "Succeeded to update model weights. Weight version updated to 3."}
        running["thread"].join(30)
        out = running["value"]
        # the update waited: the request ran to its end, every token on the old weights
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG["max_new_tokens"]}
        expected = unpadded_logprobs(old_model, [5, 6], out["output_ids"])
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        assert (expected - got).abs().max().item() < 1e-4
        after = generate(server, max_new_tokens=3, temperature=0)
        assert after["meta_info"]["weight_version"] == "3"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        assert_logprobs_match(server, [5, 6, 7], after)
        assert http_json("GET", server.url + "/get_weight_version")[1] == {"weight_version": "3"}
        assert http_json("GET", server.url + "/model_info")[1]["weight_version"] == "3"
        status, body = http_json("POST", server.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "no")})
        assert status == 400 and body["success"] is False and "no *.safetensors" in body["message"]
    finally:
        server.load_weights(original, "default")
    assert generate(server, max_new_tokens=3, temperature=0)["output_ids"] == before["output_ids"]


def test_load_weights_in_memory_is_strict(embedded_engine):
    server = embedded_engine
    original = {k: v.clone() for k, v in server.model.state_dict().items()}
    try:
        assert server.load_weights([(k, v * 0.5) for k, v in original.items()], "5") == "5"
        assert generate(server, max_new_tokens=1)["meta_info"]["weight_version"] == "5"
        partial = dict(original)
        del partial["model.norm.weight"]
        with pytest.raises(ValueError, match="missing.*model.norm.weight"):
            server.load_weights(partial, "6")
        wrong = dict(original, **{"model.norm.weight": torch.zeros(3)})
        with pytest.raises(ValueError, match=r"model.norm.weight: shape \(3,\)"):
            server.load_weights(wrong, "6")
        with pytest.raises(ValueError, match="unexpected.*bogus"):
            server.load_weights(dict(original, bogus=torch.zeros(1)), "6")
        assert server.weight_version == "5"
    finally:
        server.load_weights(original, "default")


def test_seeded_sampling_repeats_and_logit_adjustments_apply(embedded_engine):
    params = {"max_new_tokens": 8, "ignore_eos": True, "top_p": 0.9, "sampling_seed": 11}
    assert generate(embedded_engine, **params)["output_ids"] == generate(embedded_engine, **params)["output_ids"]
    biased = generate(embedded_engine, max_new_tokens=4, ignore_eos=True, logit_bias={"42": 100.0})
    assert biased["output_ids"] == [42] * 4  # the bias is applied before the softmax, as in SGLang
    assert all(e[0] > -1e-3 for e in biased["meta_info"]["output_token_logprobs"])
    penalised = generate(embedded_engine, max_new_tokens=4, ignore_eos=True, temperature=0, logit_bias={"42": 5.0},
                         frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    assert penalised["output_ids"].count(42) < 4


def test_engine_actor_under_ray(ray_session, tiny_checkpoint):
    from slimecore.engines.embedded_actors import launch_embedded_engines

    (actor, url), = launch_embedded_engines(1, str(tiny_checkpoint), num_cpus=0.5, timeout=scaled(120))
    try:
        assert ray_session.get(actor.health.remote(), timeout=scaled(30)) is True
        from transformers import AutoModelForCausalLM

        weights = {k: v * 2 for k, v in AutoModelForCausalLM.from_pretrained(tiny_checkpoint).state_dict().items()}
        assert ray_session.get(actor.load_weights.remote(ray_session.put(weights), "2"), timeout=scaled(60)) == "2"
        status, out = http_json("POST", url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})
        assert status == 200 and out["meta_info"]["weight_version"] == "2"
        ray_session.get(actor.shutdown.remote(), timeout=scaled(30))
    finally:
        ray_session.kill(actor)


def test_engine_weights_are_not_views_of_the_checkpoint_file(tiny_checkpoint):
    """transformers loads same-dtype weights as copy-on-write views of the mapped safetensors file; the engine
    copies them once at load, so the weight update before the first rollout writes memory of its own instead
    of copying the file page by page on faults."""
    from transformers import AutoModelForCausalLM

    from slimecore.engines.embedded import _own_weights

    def file_backed(model) -> int:
        spans = []
        for line in open("/proc/self/maps"):
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
        return sum(any(s <= p.data_ptr() < e for s, e in spans) for p in model.parameters())

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if file_backed(model) == 0:
        pytest.skip("this transformers copies the weights on load: nothing maps the checkpoint file")
    _own_weights(model)
    assert file_backed(model) == 0
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
