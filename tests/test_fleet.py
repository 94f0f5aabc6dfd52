"""The engine fleet's monitor and weight admission on real parts: two embedded engine actors started by
the run's ``EngineLauncher`` in Ray, the real sglang-router, real processes stopped and killed.

- Engines are probed side by side: one engine stopped with SIGSTOP (alive, hung) and one killed with
  SIGKILL at the same moment are both found and replaced, the killed one without waiting for the hung one's
  probe to time out.
- After a trainer push (tensor transport), a restarted engine goes back into the router only when it
  serves the version just pushed: a push that missed it (it restarted meanwhile) leaves it out; when no
  engine serves the pushed weights, the trainers push them again to the restarted engines.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from slimecore.testing import timeout

CHECK_TIMEOUT = timeout(12)


def _pid(ray, actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout(30))


def _wait_for(condition, limit: float, what: str, poll: float = 0.1) -> float:
    """Seconds until ``condition()`` holds; fails the test after ``limit`` seconds."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit, f"{what}: not within {limit:.0f}s"
        time.sleep(poll)
    return time.monotonic() - start


@pytest.fixture()
def fleet(ray_session, tiny_checkpoint):
    from slimecore.config import Config
    from slimecore.engines.fleet import EngineFleet
    from slimecore.engines.launch import EngineLauncher
    from slimecore.engines.router import Router

    config = Config.make(hf_checkpoint=str(tiny_checkpoint), rollout_num_gpus=2, num_cpus_per_actor=0.1,
                         ray_timeout=timeout(180))
    fleet = EngineFleet(EngineLauncher(config), 2, Router([]), check_interval=0.5, check_timeout=CHECK_TIMEOUT)
    yield fleet.start()
    fleet.stop()


def _push(fleet, version: str, urls: list[str]) -> None:
    """What train rank 0 does at a weight sync: the checkpoint's weights, as ``version``, to ``urls``."""
    from transformers import AutoModelForCausalLM

    from slimecore.engines import weight_sync
    from slimecore.trainers.weight_sender import Endpoint, WeightSender

    model = AutoModelForCausalLM.from_pretrained(fleet.lifecycle.config.hf_checkpoint)
    named = list(weight_sync.unique_tensors(model.state_dict().items()))
    WeightSender(timeout=timeout(120)).push([named], [Endpoint(url) for url in urls], version, "tensor")


def test_a_hung_engine_delays_no_other_and_both_come_back(ray_session, fleet):
    (hung, hung_url), (dead, dead_url) = fleet.engines
    hung_pid, dead_pid = _pid(ray_session, hung), _pid(ray_session, dead)
    os.kill(hung_pid, signal.SIGSTOP)
    os.kill(dead_pid, signal.SIGKILL)
    try:
        workers = lambda: fleet.router.list_workers()
        # the killed engine's probe is refused at once: out of the router well before the hung one's deadline
        seconds = _wait_for(lambda: dead_url not in workers(), CHECK_TIMEOUT, "the killed engine leaves the router")
        assert seconds < CHECK_TIMEOUT / 2, seconds
        assert hung_url in workers()  # its probe is still waiting
        # the hung engine: found within one interval and its probe's deadline
        _wait_for(lambda: hung_url not in workers(), 0.5 + CHECK_TIMEOUT + timeout(5), "the hung engine leaves")
    finally:
        os.kill(hung_pid, signal.SIGCONT)  # killed by the fleet by now; if not, let it stop normally
    # both restarted on their bundles, new processes on new ports, and serving behind the router again
    _wait_for(lambda: {hung_url, dead_url}.isdisjoint(fleet.urls) and sorted(workers()) == sorted(fleet.urls),
              timeout(180), "both engines back in the router")
    assert all(fleet.healthy(url) for url in fleet.urls)
    assert fleet.metrics()["rollout/engine_restarts"] == 2


def test_a_restarted_engine_waits_for_a_push_that_reaches_it(ray_session, fleet):
    _push(fleet, "1", fleet.urls)
    fleet.admit_pushed("1")
    assert [fleet.served_version(url) for url in fleet.urls] == ["1", "1"]
    workers = fleet.router.list_workers
    (_, keep_url), (restarted, old_url) = fleet.engines
    os.kill(_pid(ray_session, restarted), signal.SIGKILL)
    _wait_for(lambda: fleet.engines[1][1] != old_url, timeout(180), "the killed engine restarted")
    new_url = fleet.urls[1]
    assert fleet.served_version(new_url) == "default"  # the checkpoint's weights, not v1
    assert workers() == [keep_url]  # out of the router: the other engine serves the pushed weights
    # a push that missed it (the engine list was read before it came back) does not let it in
    _push(fleet, "2", [keep_url])
    fleet.admit_pushed("2")
    assert workers() == [keep_url] and fleet.served_version(new_url) == "default"
    # the next push reaches it: back in the router, serving that version
    _push(fleet, "3", fleet.urls)
    fleet.admit_pushed("3")
    assert sorted(workers()) == sorted(fleet.urls) and [fleet.served_version(u) for u in fleet.urls] == ["3", "3"]


def test_with_no_engine_on_the_pushed_weights_the_trainers_push_again(ray_session, fleet):
    """The case of one engine, or of every engine failing before the next push (a rollout waits for engines,
    so no push would come): the fleet asks for a push again (``repush_request``, served by the driver in a run,
    slimecore.weight_updates); the trainers push the weights they hold, which may be a version newer than the
    last push (they trained a step since), and the engines go back in serving that version."""
    fleet.trainers_push = True
    assert fleet.repush_request(0.1) == []  # nothing asked while the engines serve the pushed weights
    _push(fleet, "1", fleet.urls)
    fleet.admit_pushed("1")
    old = list(fleet.urls)
    for handle, _ in fleet.engines:
        os.kill(_pid(ray_session, handle), signal.SIGKILL)
    asked: list[list[str]] = []

    def driver() -> bool:  # what WeightRepush does: the trainers hold v2 now
        urls = fleet.repush_request(0.1)
        if urls:
            asked.append(urls)
            _push(fleet, "2", urls)
            fleet.repushed("2")
        return set(old).isdisjoint(fleet.urls) and sorted(fleet.router.list_workers()) == sorted(fleet.urls)

    _wait_for(driver, timeout(240), "both engines back in the router")
    assert [fleet.served_version(url) for url in fleet.urls] == ["2", "2"]
    assert asked and all(set(urls) <= set(fleet.urls) for urls in asked[-1:]), asked
    # a push again that a regular push overtook (v3 reached every engine first) changes nothing
    _push(fleet, "3", fleet.urls)
    fleet.admit_pushed("3")
    fleet.repushed("2")
    assert sorted(fleet.router.list_workers()) == sorted(fleet.urls)
