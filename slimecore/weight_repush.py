"""The driver has the trainers push their weights again to engines restarted while no engine served them.

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
the run with :class:`~slimecore.trainers.actor.TrainTimeout`, naming the rank and this stage.
"""

from __future__ import annotations

import _thread
import logging
import threading

from slimecore.config import Config
from slimecore.raytools import ray_get
from slimecore.weight_updates import resolve_transport

log = logging.getLogger("slimecore.weights")

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
