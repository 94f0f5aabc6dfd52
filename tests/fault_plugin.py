"""Test plugin: breaks an engine or the router in the middle of a rollout, as a crash, a hang or an OOM
killer would, from inside the rollout process of a real run.

``--fault-at STEP:KIND ...`` with KIND ``engine-kill`` (SIGKILL the first engine the router lists),
``engine-stop`` (SIGSTOP it: alive but hung) or ``router-kill`` (SIGKILL the sglang-router). At that step
the first sample's generate waits a moment, so that the other samples' requests are in flight, injects the
fault, then generates as the built-in hook does. ``--fault-log FILE`` gets one JSON line per fault, per
generated sample (its step and the weight versions that produced it) and per trained sample (the weight version
it is labelled with, and how far the engine's log-probs are from the trainer's, whose weights are the version
of the step it trains at: a label is true when these agree exactly for the step's version only).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import psutil

from slimecore import hookimpl
from slimecore.config import Option
from slimecore.defaults import rollout as builtin

_injected: set[int] = set()
_step = 0  # the step being generated


@hookimpl
def slime_options():
    return [Option("fault_at", str, [], "STEP:KIND faults to inject (engine-kill, engine-stop, router-kill).",
                   nargs="*"),
            Option("fault_log", str, None, "JSON-lines file of injected faults and generated samples.")]


def _log(config, record: dict) -> None:
    with open(config.plugin("fault_plugin").fault_log, "a") as f:
        f.write(json.dumps(record) + "\n")


def _router() -> psutil.Process:
    """The router: the child process of this (the rollout manager's) that listens on the client's port."""
    return next(p for p in psutil.Process().children() if "router" in " ".join(p.cmdline()))


def _live_engine_pid(router_url: str) -> tuple[int, str]:
    """The first engine the router lists that is running (a killed one may still be listed for a moment)."""
    with urllib.request.urlopen(f"{router_url}/workers", timeout=10) as response:
        data = json.loads(response.read())
    listening = {c.laddr.port: c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for url in sorted(w["url"] for w in data["workers"]):
        pid = listening.get(int(url.rsplit(":", 1)[1]))
        if pid is not None and psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            return pid, url
    raise RuntimeError(f"no running engine among the router's workers {data['workers']}")


def _inject(config, rollout_id: int, kind: str, router_url: str) -> None:
    if kind == "router-kill":
        pid, target = _router().pid, "router"
        os.kill(pid, signal.SIGKILL)
    else:
        pid, target = _live_engine_pid(router_url)
        os.kill(pid, signal.SIGKILL if kind == "engine-kill" else signal.SIGSTOP)
    _log(config, {"fault": kind, "rollout_id": rollout_id, "pid": pid, "target": target})


@hookimpl
def slime_log_rollout(config, rollout_id):
    global _step
    _step = rollout_id + 1  # the next generate calls belong to the next step (the sync loop, no eval)


@hookimpl
def slime_process_sample(config, sample, rollout_id, evaluation):
    if config.plugin("fault_plugin").fault_log:
        _log(config, {"rollout_id": rollout_id, "weight_versions": list(sample.weight_versions)})


@hookimpl
def slime_train_inputs(config, role):
    return ["log_probs"] if config.plugin("fault_plugin").fault_log else []


@hookimpl
def slime_rollout_data_postprocess(config, rollout_id, batch):
    if not config.plugin("fault_plugin").fault_log:
        return
    for label, trained, engine in zip(batch["weight_versions"], batch["log_probs"], batch["rollout_log_probs"]):
        _log(config, {"trained_at": rollout_id, "label": label, "logprob_diff": float((trained - engine).abs().max())})


@hookimpl
async def slime_generate(config, sample, sampling_params, client, evaluation, observation, agent):
    faults = dict(item.split(":") for item in config.plugin("fault_plugin").fault_at)
    if not evaluation and str(_step) in faults and _step not in _injected:
        _injected.add(_step)
        await asyncio.sleep(0.05)  # the other samples' requests are sent meanwhile
        _inject(config, _step, faults[str(_step)], client.url)
    return await builtin.slime_generate(config=config, sample=sample, sampling_params=sampling_params, client=client,
                                        observation=observation, agent=agent)
