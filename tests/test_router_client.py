"""The rollout client against the real sglang-router in front of two embedded engines: routing, error
handling and retries, abort_all, cache flush, disk weight updates, dynamic workers, readiness errors."""

from __future__ import annotations

import asyncio
import time

import pytest
from fixtures_engine import http_json

from slimecore.engines.router import Router, free_port
from slimecore.sglang_schema import class_fields
from slimecore.rollout.client import EngineError, RolloutClient, SharedRequests
from slimecore.testing import timeout as scaled


def test_round_robin_over_two_engines_and_worker_urls(engines):
    servers, router = engines
    client = RolloutClient(router.url)
    before = [s.stats["waves"] for s in servers]
    for _ in range(4):  # one at a time: each request is its own wave on the engine that got it
        out = client.run_sync(client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True}))
        assert len(out["meta_info"]["output_token_logprobs"]) == 2
    assert [s.stats["waves"] - b for s, b in zip(servers, before)] == [2, 2]
    assert sorted(client.run_sync(client.worker_urls())) == sorted(s.url for s in servers)
    assert sorted(router.list_workers()) == sorted(s.url for s in servers)


def test_text_prompts_and_router_fields_reach_the_engine(engines):
    servers, router = engines
    client = RolloutClient(router.url, tokenizer=servers[0].tokenizer)
    out = client.run_sync(client.generate(text="What is 3 + 4?", sampling_params={
        "max_new_tokens": 3, "temperature": 0, "top_p": 1.0, "top_k": -1, "stop": None, "stop_token_ids": None,
        "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}))
    assert out["meta_info"]["prompt_tokens"] == len(client.tokenizer("What is 3 + 4?").input_ids)
    assert out["meta_info"]["weight_version"] == "default"
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    with pytest.raises(ValueError, match="exactly one"):
        client.run_sync(client.generate([1], text="both"))


def test_bad_requests_raise_at_once_with_the_engine_message(engines):
    _, router = engines
    client = RolloutClient(router.url, max_retries=5)
    start = time.perf_counter()
    with pytest.raises(EngineError, match=r"HTTP 400.*temperature"):
        client.run_sync(client.generate([1, 2], {"temperature": -1}))
    assert time.perf_counter() - start < 2  # not retried


def test_shared_requests_send_a_group_as_one_batch_through_the_router(engines):
    """Inside SharedRequests, calls made together with the same params go out as one SGLang batch request
    (through the real router); each caller gets what its own request would have got."""
    servers, router = engines
    client = RolloutClient(router.url)
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13], [5, 6, 7]]
    alone = [client.run_sync(client.generate(p, greedy)) for p in prompts]
    sent = []
    original = client._request

    async def recording(method, url, body=None, **kwargs):
        sent.append(body)
        return await original(method, url, body, **kwargs)

    client._request = recording
    calls = sum(s.stats["generate_calls"] for s in servers)

    async def group():
        with SharedRequests():
            tasks = [asyncio.ensure_future(client.generate(p, greedy)) for p in prompts]
            tasks.append(asyncio.ensure_future(client.generate([9], dict(greedy, max_new_tokens=2))))  # other params
            tasks.append(asyncio.ensure_future(client.generate([9], greedy, rid="mine")))  # its own rid: alone
            late = asyncio.ensure_future(client.generate([1, 2], greedy))
            await asyncio.sleep(0)
            late.cancel()  # its caller gave up before the request went out: not sent
            outs = await asyncio.gather(*tasks)
        alone_out = await client.generate([9], greedy)  # outside the block: its own request
        await client.close()
        return outs, late, alone_out

    outs, late, alone_out = asyncio.run(group())
    assert [o["output_ids"] for o in outs[:4]] == [a["output_ids"] for a in alone]
    assert len(outs[4]["output_ids"]) == 2 and outs[5]["meta_info"]["id"] == "mine"
    assert late.cancelled() and alone_out["output_ids"] == alone[1]["output_ids"]
    assert sum(s.stats["generate_calls"] for s in servers) - calls == 4 == len(sent)
    batch = next(body for body in sent if isinstance(body["input_ids"][0], list))
    assert batch["input_ids"] == prompts and batch["sampling_params"] == greedy and "rid" not in batch
    assert sorted((b["input_ids"], b["sampling_params"]["max_new_tokens"], b.get("rid", "")) for b in sent if b is not batch) \
        == [([9], 2, ""), ([9], 3, ""), ([9], 3, "mine")]
    fields = class_fields("srt.managers.io_struct", "GenerateReqInput")
    assert fields is None or set(batch) <= set(fields)  # SGLang's own request class has each field we send

    async def bad_group():
        with SharedRequests():
            return await asyncio.gather(*(client.generate(p, {"temperature": -1}) for p in prompts[:2]),
                                        return_exceptions=True)

    errors = client.run_sync(bad_group())
    assert all(isinstance(e, EngineError) and "HTTP 400" in str(e) and "temperature" in str(e) for e in errors)


def test_a_shared_request_whose_callers_all_gave_up_is_cancelled(engines):
    servers, router = engines
    client = RolloutClient(router.url)
    shared = SharedRequests()

    async def scenario():
        with shared:
            tasks = [asyncio.ensure_future(client.generate([5, 6, 7], {"max_new_tokens": 400, "ignore_eos": True}))
                     for _ in range(2)]
        while sum(s.loads()["num_running_reqs"] for s in servers) < 2:
            await asyncio.sleep(0.01)
        assert len(shared._sending) == 1
        tasks[0].cancel()
        await asyncio.sleep(0.05)
        assert len(shared._sending) == 1  # the other caller still waits for it
        tasks[1].cancel()
        await asyncio.sleep(0.05)
        assert not shared._sending  # no caller left: the HTTP request was cancelled
        await client.abort_all(timeout=scaled(30))
        await client.close()
        return [t.cancelled() for t in tasks]

    assert asyncio.run(scenario()) == [True, True]


def test_unreachable_and_5xx_are_retried_then_named(tmp_path, engines):
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient(dead, max_retries=1)
    with pytest.raises(EngineError, match=rf"POST {dead}/generate failed after 2 attempts; last error: Client"):
        client.run_sync(client.generate([1], {}))
    # a router without workers answers 503 (retryable); after add_worker it serves, after remove_worker not
    servers, _ = engines
    router = Router([], log_dir=str(tmp_path), startup_timeout=30).start()
    try:
        client = RolloutClient(router.url, max_retries=1)
        with pytest.raises(EngineError, match="failed after 2 attempts; last error: HTTP 503"):
            client.run_sync(client.generate([1], {"max_new_tokens": 1}))
        router.add_worker(servers[0].url)
        assert client.run_sync(client.generate([1], {"max_new_tokens": 1}))["output_ids"]
        router.remove_worker(servers[0].url)
        assert router.list_workers() == [] and router.worker_urls == []
        with pytest.raises(ValueError, match="not a worker"):
            router.remove_worker(servers[0].url)
    finally:
        router.stop()


def test_abort_all_returns_partial_outputs_and_leaves_engines_idle(engines):
    servers, router = engines
    client = RolloutClient(router.url)

    async def scenario():
        try:
            tasks = [asyncio.ensure_future(client.generate([5, 6, 7], {"max_new_tokens": 400, "ignore_eos": True}))
                     for _ in range(4)]
            while sum(s.loads()["num_running_reqs"] for s in servers) < 4:
                await asyncio.sleep(0.01)
            await client.abort_all(timeout=scaled(30))
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            await client.close()

    outs = asyncio.run(scenario())
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < 400
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    for server in servers:
        load = http_json("GET", server.url + "/v1/loads?include=core")[1]["loads"][0]
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    client.run_sync(client.flush_cache(timeout=scaled(10)))


def test_update_weights_from_disk_reaches_every_engine(engines, tmp_path):
    from safetensors.torch import save_file

    servers, router = engines
    weights = {k: v.clone() for k, v in servers[0].model.state_dict().items()}  # both engines hold these
    save_file(weights, str(tmp_path / "model.safetensors"))
    client = RolloutClient(router.url)
    try:
        client.run_sync(client.update_weights_from_disk(str(tmp_path), "4"))
        assert [http_json("GET", s.url + "/get_weight_version")[1]["weight_version"] for s in servers] == ["4", "4"]
        with pytest.raises(EngineError, match="no \\*.safetensors"):
            client.run_sync(client.update_weights_from_disk(str(tmp_path / "missing"), "5"))
    finally:
        for server in servers:
            server.load_weights(weights, "default")


def test_readiness_error_names_the_dead_worker_and_shows_the_log(tmp_path, engines):
    servers, _ = engines
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.perf_counter()
    with pytest.raises(TimeoutError) as err:
        Router([servers[0].url, dead], startup_timeout=2, log_dir=str(tmp_path)).start()
    message = str(err.value)
    assert f"{dead} (not registered; GET {dead}/health failed" in message
    assert "1/2 healthy workers" in message and "Router log tail:" in message
    assert time.perf_counter() - start < 15


def test_abort_skips_an_engine_that_is_gone(engines):
    """An engine that died (refused) has nothing left to abort: it counts as idle at once, while a live one
    is aborted and polled as usual; the fault monitor replaces the dead one."""
    servers, router = engines
    client = RolloutClient(router.url, max_retries=20)

    async def main():
        start = time.perf_counter()
        busy = [await client._abort_on(url) for url in (f"http://127.0.0.1:{free_port()}", servers[0].url)]
        await client.close()
        return busy, time.perf_counter() - start

    busy, seconds = asyncio.run(main())
    assert busy == [0, 0] and seconds < 5


def test_an_api_key_that_starts_with_a_dash_reaches_router_and_engine(tiny_checkpoint, tmp_path):
    """A per-run key is random (``secrets.token_urlsafe``), so one run in 64 gets a key that starts with
    ``-``: the router's argparse must still take it as the value of ``--api-key``, and requests need it."""
    from slimecore.testing.engines import embedded_engine

    key = "-" + "k" * 31
    with embedded_engine(tiny_checkpoint, max_batch_size=2, api_key=key) as server:
        router = Router([server.url], api_key=key, log_dir=str(tmp_path)).start()
        try:
            assert http_json("POST", router.url + "/generate", {"input_ids": [5], "sampling_params": {}})[0] == 401
            client = RolloutClient(router.url, api_key=key)
            out = client.run_sync(client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True}))
            assert len(out["meta_info"]["output_token_logprobs"]) == 2
        finally:
            router.stop()


def test_the_router_process_is_sglang_routers_own_launch(tmp_path):
    """``Router.spawn`` runs the sglang-router as its launcher does (its arguments, its process title), without
    the launcher's Python load balancer: a bad argument is refused by the router's own parser."""
    import subprocess
    import sys

    router = Router([], log_dir=str(tmp_path)).spawn()
    try:
        router.wait_ready(0, timeout=scaled(60))
        assert open(f"/proc/{router.process.pid}/cmdline").read().startswith("sglang::router")
    finally:
        router.stop()
    bad = subprocess.run([sys.executable, "-m", "slimecore.engines.router_process", "--policy", "nope"],
                         capture_output=True, text=True, timeout=scaled(60))
    assert bad.returncode == 2 and "--policy: invalid choice: 'nope'" in bad.stderr
    assert "sglang_router.mini_lb" not in subprocess.run(
        [sys.executable, "-c", "import sys, runpy; sys.argv = ['x', '--help']\n"
         "try:\n runpy.run_module('slimecore.engines.router_process', run_name='__main__')\n"
         "except SystemExit:\n pass\nprint(' '.join(sys.modules))"], capture_output=True, text=True,
        timeout=scaled(60)).stdout
