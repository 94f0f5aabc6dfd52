"""Driver side of handing the weights (and, colocated, the devices) from the trainer to the engines.

Every update runs as SGLang's clients run it: the rollout manager pauses generation and flushes every
engine's cache, the weights go over the chosen transport with ``weight_version`` = the new policy
version, and generation continues. With ``--offload-rollout`` the engines release their weights and KV
cache while the trainer trains and resume them in SGLang's order (weights, the update, then KV cache);
with ``--offload-train`` the trainer's state leaves the device once the engines need it.

``WeightRepush``: the driver has the trainers push their weights again to engines restarted while no engine served them.

With the trainers' own push (``tensor`` / ``distributed`` transport) a restarted engine waits out of the
router for the next push (``slimecore.engines.fleet``). When no engine is left in the router, that push
would never come: the rollout waits for engines while the driver waits for the rollout. The fleet then
asks for a push again, and this thread in the driver, long-polling the rollout manager in its
:data:`REPUSH` concurrency group (served while a step runs in the default one), sends it.

It is sent from the driver because the push is a call to every train rank (gathering sharded weights is
collective): Ray runs an actor's calls in the order one process submitted them, and ``TrainGroup`` submits
each call to all ranks under one lock, so every rank sees this push and the driver's step in the same order.
Sent from the rollout manager instead, a rank could get the push before a step and another rank after it,
and both would wait in different collectives until ``--train-timeout``. The trainers label the weights
with the version they are (they may have trained a step since the last push), and a rank that hangs fails
the run with :class:`~slimecore.trainers.ray_actors.TrainTimeout`, naming the rank and this stage.
"""

from __future__ import annotations

import _thread
import logging
import shutil
import threading
from pathlib import Path
from urllib.parse import urlparse

from slimecore.config import Config
from slimecore.raytools import cluster_gpus, ray_get

log = logging.getLogger("slimecore.weights")


def resolve_transport(config: Config, endpoints: list) -> str:
    """``--update-weight-transport auto``: tensor when trainer and engines share devices (``--colocate``) or,
    on CPU, a host (every engine on loopback: shared memory is the fastest CPU path,
    ``benchmarks/weight_sync.py``); distributed otherwise, as slime chooses NCCL for disaggregated GPUs."""
    if config.update_weight_transport != "auto":
        return config.update_weight_transport
    if config.colocate:
        return "tensor"
    same_host = all(urlparse(e.url).hostname in ("127.0.0.1", "localhost") for e in endpoints)
    return "tensor" if same_host and cluster_gpus() == 0 else "distributed"


def sync_weights(config: Config, train, rollout, version: int) -> float:
    """Push the trainer's weights to every engine, which then serve ``version``; returns seconds."""
    wait = config.ray_timeout
    checksum = train.checksum_kind()  # --check-weights: the engines' checksums are compared before they resume
    if config.update_weight_transport in ("disk", "object-store"):
        if config.update_weight_transport == "disk":
            weights = train.weights_ref(str(Path(config.log_dir) / "weights" / f"v{version}"))
        else:
            weights = [train.weights_ref()]  # wrapped: the manager passes the ref on instead of fetching it
        expected = train.weight_checksums(checksum) if checksum else None
        seconds = ray_get(rollout.update_weights.remote(weights, version, expected),
                          f"engines to load weights v{version}", wait)
        shutil.rmtree(Path(config.log_dir) / "weights" / f"v{version - 1}", ignore_errors=True)  # keep the newest
        return seconds
    endpoints = ray_get(rollout.pause_for_update.remote(), "the engines to pause and flush before a weight update",
                        wait)
    transport = resolve_transport(config, endpoints)
    figures = train.push_weights(endpoints, version, transport, checksum)
    ray_get(rollout.resume_after_update.remote(version, True, figures.get("checksums")),
            "the engines to check the weights and continue generating", wait)
    return figures["seconds"]


def before_train(config: Config, groups: dict, rollout) -> None:
    """Colocated: the engines give the devices up, the trainer takes them back."""
    if config.offload_rollout:
        ray_get(rollout.release_memory.remote(), "the engines to release their memory", config.ray_timeout)
    if config.offload_train:
        for group in groups.values():
            group.onload()


def after_train(config: Config, groups: dict, rollout, version: int, push: bool) -> float:
    """Colocated: the trainer gives the devices up and the engines resume, the weights of ``version``
    loaded between their weights and their KV cache. ``push``: the weights changed. Released engine weights
    are always pushed again (SGLang keeps no copy of them); returns the sync's seconds."""
    if config.offload_train:
        for group in groups.values():
            group.offload()
    if config.offload_rollout:
        ray_get(rollout.resume_memory.remote(["weights"]), "the engines to resume their weights", config.ray_timeout)
    seconds = sync_weights(config, groups["actor"], rollout, version) if push or config.offload_rollout else 0.0
    if config.offload_rollout:
        ray_get(rollout.resume_memory.remote(["kv_cache", "cuda_graph"]), "the engines to resume their KV cache",
                config.ray_timeout)
    return seconds


# ---------------------------------------------------------------------------------------------
# Pushes again to engines restarted while none served the weights
# ---------------------------------------------------------------------------------------------

REPUSH = "repush"  # the rollout manager's concurrency group for the two calls below
POLL_SECONDS = 2.0


class WeightRepush:
    """Serves the fleet's requests for a push again until ``stop``. A push that fails (a rank hung past
    ``--train-timeout``, an engine refused) ends the run: the error is kept in ``error`` and the main thread
    is interrupted, and ``slimecore.loop.run`` raises that error instead of the interruption."""

    def __init__(self, config: Config, train, rollout):
        self.config, self.train, self.rollout = config, train, rollout
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slimecore-weight-repush", daemon=True)

    def start(self) -> WeightRepush:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                endpoints = ray_get(self.rollout.repush_request.options(concurrency_group=REPUSH).remote(POLL_SECONDS),
                                    "the rollout manager's request to push weights again", self.config.ray_timeout)
            except Exception as exc:  # noqa: BLE001 - the manager is gone: the main thread meets that itself
                log.debug("stopped serving pushes again: %s", exc)
                return
            if endpoints and not self._stop.is_set():
                try:
                    self.push(endpoints)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which ends the run with it
                    if self._stop.is_set():
                        return  # the run is ending: its actors may be gone already
                    log.error("pushing the weights again to restarted engines failed: %s", exc)
                    self.error = exc
                    _thread.interrupt_main()
                    return

    def push(self, endpoints: list) -> None:
        """The trainers push the weights they hold to ``endpoints``; the fleet admits the engines serving them."""
        version, expected = self.train.push_held_weights(endpoints, resolve_transport(self.config, endpoints))
        urls = [e.url for e in endpoints]
        ray_get(self.rollout.repushed.options(concurrency_group=REPUSH).remote(version, expected, urls),
                f"the restarted engines to take the weights v{version}", self.config.ray_timeout)
        log.warning("the trainers pushed their weights v%s again to %s", version, [e.url for e in endpoints])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=POLL_SECONDS + 5)
