"""The embedded engine behind the real sglang-router, over real HTTP, with the rollout client."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import torch

from slimecore.rollout.client import EngineError, RolloutClient
from slimecore.testing import timeout as scaled


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=scaled(60)) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _get(url):
    with urllib.request.urlopen(url, timeout=scaled(30)) as r:
        return json.loads(r.read() or b"null")


def _gen(client, *args, **kw):
    return asyncio.run(_once(client, *args, **kw))


async def _once(client, *args, **kw):
    try:
        return await client.generate(*args, **kw)
    finally:
        await client.close()


def test_generate_shapes_logprobs_and_finish_reasons(engines):
    servers, router = engines
    out = _gen(RolloutClient(router.url), [5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert len(out["output_ids"]) == 6 == meta["completion_tokens"] == len(meta["output_token_logprobs"])
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["prompt_tokens"] == 4 and meta["weight_version"] == "default"
    # the value is log_softmax(logits / T) of an unpadded forward, as the trainer computes it
    model = servers[0].model
    ids = torch.tensor([[5, 6, 7, 8] + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)[3:-1]
    expected = logp.gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
    got = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    assert (expected - got).abs().max().item() < 1e-4


def test_stop_token_and_stop_string(engines):
    servers, router = engines
    eos = servers[0].tokenizer.eos_token_id
    out = _gen(RolloutClient(router.url), [5, 6], {"max_new_tokens": 30, "temperature": 1.0, "stop_token_ids": list(range(400))})
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["output_ids"]) == 1
    assert out["meta_info"]["finish_reason"]["matched"] == out["output_ids"][0]
    server = servers[0]
    # a stop string: the tokens completing it are kept, the text is cut unless no_stop_trim
    first = _post(server.url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                                     "ignore_eos": True}})[1]
    pieces = [server.tokenizer.decode([t]) for t in first["output_ids"]]
    stop = next((p for p in pieces[1:] if p.strip().isalnum()), None)
    if stop is None:
        pytest.skip("the random model produced no plain-text token to stop on")
    for trim in (False, True):
        status, out = _post(server.url + "/generate", {"input_ids": [5, 6], "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "stop": [stop], "no_stop_trim": trim, "ignore_eos": True}})
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
        assert (stop in out["text"]) == trim
    assert eos in server.eos_ids


def test_invalid_requests_get_400(engines):
    servers, _ = engines
    url = servers[0].url + "/generate"
    for params in ({"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"bogus": 1}, {"max_new_tokens": -2}):
        status, body = _post(url, {"input_ids": [1, 2], "sampling_params": params})
        assert status == 400 and "message" in body["error"], params
    assert _post(url, {"sampling_params": {}})[0] == 400
    assert _post(servers[0].url + "/update_weights_from_tensor", {})[1]["success"] is False


def test_concurrent_requests_share_a_decode_wave(engines):
    servers, _ = engines
    client = RolloutClient(servers[1].url)

    async def many():
        try:
            return await asyncio.gather(*(client.generate([5, 6, 7], {"max_new_tokens": 4, "ignore_eos": True})
                                          for _ in range(12)))
        finally:
            await client.close()

    outs = asyncio.run(many())
    assert all(len(o["output_ids"]) == 4 for o in outs)
    assert _get(servers[1].url + "/server_info")["internal_states"][0]["max_wave_size"] >= 6


def test_abort_all_returns_partial_outputs_and_leaves_engines_idle(engines):
    servers, router = engines
    client = RolloutClient(router.url)

    async def scenario():
        try:
            tasks = [asyncio.ensure_future(client.generate([5, 6, 7], {"max_new_tokens": 100000, "ignore_eos": True}))
                     for _ in range(4)]
            # abort as soon as all four decode: the engine reaches the 512-token context in well under a second
            deadline = time.time() + scaled(30)
            while sum(s.loads()["num_running_reqs"] for s in servers) < 4 and time.time() < deadline:
                await asyncio.sleep(0.005)
            await client.abort_all()
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    outs = asyncio.run(scenario())
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert any(len(o["output_ids"]) > 0 for o in outs)
    for o in outs:
        assert len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])
    for server in servers:
        load = _get(server.url + "/v1/loads?include=core")["loads"][0]
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_weight_updates_change_outputs_and_version(engines, tmp_path):
    servers, _ = engines
    server = servers[0]
    params = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    before = _post(server.url + "/generate", params)[1]
    original = {k: v.clone() for k, v in server.model.state_dict().items()}
    try:
        changed = {k: v * 1.5 for k, v in original.items()}
        assert server.load_weights(changed, "7") == "7"
        after = _post(server.url + "/generate", params)[1]
        assert after["meta_info"]["weight_version"] == "7"
        assert after["meta_info"]["output_token_logprobs"][0][0] != before["meta_info"]["output_token_logprobs"][0][0]
        from safetensors.torch import save_file

        save_file(original, str(tmp_path / "model.safetensors"))
        status, body = _post(server.url + "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "8"})
        assert status == 200 and body["success"] and "Weight version updated to 8" in body["message"]
        assert _get(server.url + "/get_weight_version") == {"weight_version": "8"}
        again = _post(server.url + "/generate", params)[1]
        assert again["output_ids"] == before["output_ids"]
        with pytest.raises(ValueError, match="missing"):
            server.load_weights({"lm_head.weight": original["lm_head.weight"]}, "9")
        status, body = _post(server.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
        assert status == 400 and body["success"] is False
    finally:
        server.load_weights(original, "default")


def test_pause_holds_new_requests_until_continue(engines):
    servers, _ = engines
    server = servers[1]
    assert _post(server.url + "/pause_generation", {})[1]["status"] == "ok"
    client = RolloutClient(server.url)

    async def scenario():
        try:
            task = asyncio.ensure_future(client.generate([5, 6], {"max_new_tokens": 2}))
            await asyncio.sleep(0.3)
            assert not task.done()
            await asyncio.to_thread(_post, server.url + "/continue_generation", {})
            return await asyncio.wait_for(task, 30)
        finally:
            await client.close()

    assert len(asyncio.run(scenario())["output_ids"]) >= 1


def test_router_round_robins_and_reports_dead_workers(engines, tmp_path):
    servers, router = engines
    assert sorted(router.list_workers()) == sorted(s.url for s in servers)
    before = [s.stats["waves"] for s in servers]
    client = RolloutClient(router.url)

    async def sequential():
        try:
            for _ in range(4):
                await client.generate([5], {"max_new_tokens": 1})
        finally:
            await client.close()

    asyncio.run(sequential())
    assert all(s.stats["waves"] - b >= 1 for s, b in zip(servers, before))
    from slimecore.engines.router import Router, free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError) as err:
        Router([dead], startup_timeout=3, log_dir=str(tmp_path)).start()
    assert dead in str(err.value) and "/health" in str(err.value)


def test_client_error_after_retries_names_url():
    client = RolloutClient("http://127.0.0.1:9", max_retries=1)
    start = time.time()
    with pytest.raises(EngineError, match="failed after 2 attempts"):
        _gen(client, [1], {})
    assert time.time() - start < 10


def test_launch_embedded_engines_under_ray(ray_session, tiny_checkpoint):
    from slimecore.engines.embedded_actors import launch_embedded_engines

    (actor, url), = launch_embedded_engines(1, str(tiny_checkpoint), num_cpus=0.5, timeout=scaled(120))
    try:
        assert _get(url + "/model_info")["is_generation"] is True
        state = _get(url + "/model_info")
        assert state["architectures"] == ["Qwen2ForCausalLM"]
    finally:
        ray_session.kill(actor)
