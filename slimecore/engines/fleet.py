"""The engines behind the router, kept serving: slime's ``--use-fault-tolerance``, on by default.

A monitor thread per engine in the rollout manager probes it with ``GET /health_generate`` (a one-token
generation, so a hung scheduler fails it as surely as a dead process) under a deadline of
``--rollout-health-check-timeout`` seconds, every ``--rollout-health-check-interval`` seconds; the engines
are probed side by side, so a hung engine is found within interval + deadline and never delays the check
or the restart of another. An engine that fails the probe is

1. removed from the router, so no new request goes to it;
2. killed: its open connections close, so the requests it held fail at once and are retried on the other
   engines (by the router, else by the rollout client); what finished before is untouched;
3. started again on its own placement bundle and given the current weights and weight version;
4. added back to the router.

Step 3 depends on the transport. Weights the fleet was given (``disk``, ``object-store``) are loaded into
the new engine at once. Weights train rank 0 pushes itself (``tensor``, ``distributed``) reach it with the
next push: until then it stays out of the router, and after a push it goes back in only when it reports
the version just pushed (``weight_version`` in SGLang's ``GET /model_info``), so an engine restarted while
a push was under way, which the push missed, waits for the one after. An engine in the router that a
push missed (it could not be reached, and came back) goes out the same way. When no engine in the
router serves the pushed weights (every engine failed, or there is one engine), no push would come while
the rollout waits for engines: the fleet asks for a push again (``repush_request``), the driver has the
trainers push the weights they hold to the engines that wait (``slimecore.weight_updates``), labelled
with the version those weights are (in the async loops the trainers may have trained a step since the
last push), and the engines go back in (``repushed``). The driver, not this process, sends that push, so
its calls reach every train rank in the order of the driver's other calls (a collective gather of sharded
weights must be entered by every rank in the same order).

The router process is watched too (its exit is seen within half a second) and started again on the same
port with the engines of the moment, so the client's URL stays valid while its requests are retried.

Where slime differs: it restarts dead engines before the next weight update, so a step can run short of
engines; here an engine comes back as soon as it is replaced, with the weights the others serve. To do
that the fleet keeps the last weights it was given (a directory, or an object-store ref: one copy of the
model in Ray's object store while the run lasts). ``--no-use-fault-tolerance`` turns all of this off.

Engines are reached only through :class:`EngineLifecycle`, so any engine kind (the embedded CPU engine,
an SGLang server actor) gets the same treatment.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Protocol

from slimecore.engines.router import Router, http_json, http_request

log = logging.getLogger("slimecore.engines")


class EngineLifecycle(Protocol):
    """What the fleet needs from one kind of engine. Engine ``i`` always runs on the placement bundle
    reserved for engine ``i``; every engine serves SGLang's HTTP API at the URL ``start`` returns."""

    def start(self, indices: list[int]) -> list[tuple[Any, str]]:
        """Start these engines together, wait until each serves, return ``[(handle, url), ...]``."""

    def load_weights(self, handle: Any, url: str, weights: Any, version: str) -> None:
        """Blocking: make the engine serve ``weights`` (what ``RolloutManager.update_weights`` received)
        as ``version``. Raise ``ray.exceptions.RayActorError`` or ``OSError`` when the engine is gone."""

    def shutdown(self, handle: Any) -> None:
        """Stop the engine at once, even a hung one; never blocks for long."""


def post_update_weights_from_disk(url: str, path: str, version: str, timeout: float = 600,
                                  api_key: str | None = None) -> None:
    """``POST {url}/update_weights_from_disk``, the way every SGLang-compatible engine loads a directory."""
    status, body = http_request("POST", url + "/update_weights_from_disk",
                                {"model_path": path, "weight_version": version}, timeout=timeout, api_key=api_key)
    if status >= 300:
        raise RuntimeError(f"{url}/update_weights_from_disk({path}) -> HTTP {status}: {body[:300]!r}")


class EngineFailed(RuntimeError):
    """An engine could not be brought back; the message says which and why."""


class EngineFleet:
    """``n`` engines from ``lifecycle`` behind ``router``, with the monitor described in the module docstring
    when ``health_check`` is on. ``metrics()`` returns and resets the restart counts since the last call."""

    def __init__(self, lifecycle: EngineLifecycle, n: int, router: Router, health_check: bool = True,
                 check_interval: float = 30.0, check_timeout: float = 30.0, first_wait: float = 0.0):
        self.lifecycle, self.n, self.router, self.health_check = lifecycle, n, router, health_check
        self.check_interval, self.check_timeout, self.first_wait = check_interval, check_timeout, first_wait
        self.engines: list[tuple[Any, str]] = []
        self.error: BaseException | None = None  # a replacement that failed: the run cannot go on
        self._weights: tuple[Any, str] | None = None
        self._pushed_version: str | None = None  # the last version train rank 0 pushed (tensor / distributed)
        self._awaiting_push: set[int] = set()  # engines restarted since that push, kept out of the router
        self.trainers_push = False  # the trainers push the weights (and can push them again: repush_request)
        self._repush = threading.Event()  # set while no engine serves the pushed weights
        # current weights and engine slots change together; re-entrant, as a replacement that finds the router
        # dead restarts it (and counts that) while holding it
        self._lock = threading.RLock()
        self._router_lock = threading.RLock()  # one change to the router (a worker in or out, a restart) at a time
        self._counts = {"rollout/engine_restarts": 0, "rollout/router_restarts": 0}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def urls(self) -> list[str]:
        return [url for _, url in self.engines]

    def start(self, engines: list[tuple[Any, str]] | None = None) -> EngineFleet:
        """Start the engines (or take ``engines``, ``lifecycle.start`` of every index, already done), then the
        router in front of them and the monitor."""
        self.engines = engines if engines is not None else self.lifecycle.start(list(range(self.n)))
        if self.router.running:  # spawned while they loaded
            self.router.wait_ready(0)
            for url in self.urls:
                self.router.add_worker(url)
        else:
            self.router.worker_urls = self.urls
            self.router.start()
        if self.health_check:
            self._threads = [threading.Thread(target=self._guarded, args=(watch,), name=f"slimecore-{name}", daemon=True)
                             for name, watch in (("engine-monitor", self._watch_engines),
                                                 ("router-monitor", self._watch_router))]
            for thread in self._threads:
                thread.start()
        return self

    def metrics(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {key: float(value) for key, value in counts.items()}

    def check(self) -> None:
        """Raise the error of a replacement that failed (the monitor thread cannot raise into the step)."""
        if self.error is not None:
            raise EngineFailed(str(self.error)) from self.error

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, weights: Any, version: str, timeout: float) -> None:
        """Every engine serves ``weights`` as ``version`` when this returns. With health checks on, an
        engine that dies or hangs meanwhile is left to the monitor, which brings it back with these weights."""
        self.check()
        with self._lock:
            self._weights = (weights, version)
            targets = list(enumerate(self.engines))
        with ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="slimecore-weights") as pool:
            pending = {pool.submit(self.lifecycle.load_weights, handle, url, weights, version): (i, handle, url)
                       for i, (handle, url) in targets}
            deadline = time.monotonic() + timeout
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    i, _, url = pending.pop(future)
                    if future.exception() is not None:
                        if not (self.health_check and _engine_gone(future.exception())):
                            raise future.exception()
                        log.warning("engine %d (%s) failed while loading weights v%s (%s); the monitor replaces it",
                                    i, url, version, future.exception())
                # a replaced engine got the current weights from the monitor: stop waiting for its old self
                pending = {f: (i, h, u) for f, (i, h, u) in pending.items() if self.engines[i][0] is h}
                self.check()
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"engines {sorted(u for _, _, u in pending.values())} did not load weights "
                                       f"v{version} within {timeout:.0f}s; raise --ray-timeout if loading is slow")
            pool.shutdown(wait=False, cancel_futures=True)  # a hung engine's call ends when it is killed

    def admit_pushed(self, version: str, push_again: bool = True) -> None:
        """After train rank 0 pushed ``version``: an engine restarted since the last push goes back into the
        router if it serves ``version`` now, and an engine in the router that does not (the push missed it)
        goes out until a push reaches it; when that leaves no engine in the router, the trainers push again
        (``repush_request``). An engine that does not answer is the monitor's."""
        with self._lock:
            self._pushed_version = version
            engines = list(enumerate(self.engines))
            with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="slimecore-version") as pool:
                served = list(pool.map(lambda engine: self.served_version(engine[1][1]), engines))
            for (i, (_, url)), serves in zip(engines, served):
                if serves == version and i in self._awaiting_push:
                    self._awaiting_push.discard(i)
                    self._add_to_router(url)
                    log.warning("engine %d is back in the router, serving the pushed weights v%s", i, version)
                elif serves is not None and serves != version and i not in self._awaiting_push:
                    self._awaiting_push.add(i)
                    self._remove_from_router(url)
                    log.warning("engine %d serves weights v%s after the push of v%s; out of the router until a "
                                "push reaches it", i, serves, version)
            if push_again and len(self._awaiting_push) == self.n:
                self._push_again()

    def served_version(self, url: str) -> str | None:
        """The ``weight_version`` the engine at ``url`` serves (in SGLang's ``GET /model_info``; its older
        ``/get_weight_version`` is gone), None when it does not answer within the health-check deadline."""
        try:
            status, body = http_json("GET", url + "/model_info", timeout=self.check_timeout,
                                     api_key=self.router.api_key)
        except OSError:
            return None
        return str(body["weight_version"]) if status == 200 and isinstance(body, dict) else None

    # -- the monitor ---------------------------------------------------------------------------
    def healthy(self, url: str) -> bool:
        try:
            status, _ = http_request("GET", url + "/health_generate", timeout=self.check_timeout)
        except OSError:  # refused (dead), reset, or no answer before the deadline (hung)
            return False
        return status == 200

    def _guarded(self, watch) -> None:
        try:
            watch()
        except Exception as exc:  # noqa: BLE001 - reported to the step by check(), not lost on this thread
            log.error("%s: %s", threading.current_thread().name, exc)
            self.error = exc

    def _watch_engines(self) -> None:
        """One watcher per engine: a probe that waits out its deadline on a hung engine delays no other."""
        watchers = [threading.Thread(target=self._guarded, args=(lambda i=i: self._watch_engine(i),),
                                     name=f"slimecore-engine-monitor-{i}", daemon=True) for i in range(self.n)]
        for watcher in watchers:
            watcher.start()
        for watcher in watchers:
            watcher.join()

    def _watch_engine(self, i: int) -> None:
        if self._stop.wait(self.first_wait):
            return
        while not self._stop.is_set():
            if not self.healthy(self.engines[i][1]) and not self._stop.is_set():
                self._replace(i)
            self._stop.wait(self.check_interval)

    def _watch_router(self) -> None:
        """Apart from the engines' checks, so a router that dies while an engine reloads comes back at once."""
        while not self._stop.wait(0.5):
            with self._router_lock:
                if self.router.process is not None and not self.router.running:
                    self._restart_router()

    def _restart_router(self) -> None:
        with self._lock:
            self._counts["rollout/router_restarts"] += 1
        with self._router_lock:
            log.warning("sglang-router exited with code %s; starting it again on port %d. Log tail:\n%s",
                        self.router.process.returncode, self.router.port, self.router.log_tail())
            self.router.restart()

    def _add_to_router(self, url: str) -> None:
        with self._router_lock:
            try:
                self.router.add_worker(url, timeout=self.check_timeout + 60)
            except (OSError, RuntimeError):
                if self.router.process is None or self.router.process.poll() is None:  # up, or not ours
                    raise
                if url not in self.router.worker_urls:
                    self.router.worker_urls.append(url)
                self._restart_router()  # it starts with every worker, this one included

    def _remove_from_router(self, url: str) -> None:
        with self._router_lock:
            if url not in self.router.worker_urls:
                return
            try:
                self.router.remove_worker(url)
            except (OSError, RuntimeError, ValueError) as exc:  # the router is down: it restarts without it
                log.warning("could not remove %s from the router: %s", url, exc)
                self.router.worker_urls.remove(url)

    def _replace(self, i: int) -> None:
        """Take engine ``i`` out of the router, kill it, start it again, load the current weights, put it back."""
        handle, url = self.engines[i]
        log.warning("engine %d (%s) failed its health check (GET /health_generate, %.0fs deadline); restarting it",
                    i, url, self.check_timeout)
        with self._lock:  # counted when the fault is found, so the step it hit shows it
            self._counts["rollout/engine_restarts"] += 1
        self._remove_from_router(url)
        self.lifecycle.shutdown(handle)
        started = time.perf_counter()
        (new, new_url), = self.lifecycle.start([i])
        with self._lock:
            self.engines[i] = (new, new_url)
            if self._weights is None and self._pushed_version is not None:
                # weights reach engines by train rank 0's push (tensor / distributed): out of the router until a
                # push gives it the current weights (admit_pushed puts it back), at once when no engine serves them
                self._awaiting_push.add(i)
                if len(self._awaiting_push) == self.n:
                    self._push_again()
            else:  # the weights the fleet was given, or before the first sync the checkpoint's, as every engine
                if self._weights is not None:
                    self.lifecycle.load_weights(new, new_url, *self._weights)
                self._add_to_router(new_url)
        log.warning("engine %d is back at %s after %.1fs%s", i, new_url, time.perf_counter() - started,
                    f", serving weights v{self._weights[1]}" if self._weights else "")

    def _push_again(self) -> None:
        """No engine in the router serves the pushed weights, so no push would come (the rollout waits for the
        engines): ask the trainers to push their weights again to the engines that wait (``repush_request``)."""
        urls = [self.engines[j][1] for j in sorted(self._awaiting_push)]
        if not self.trainers_push:
            log.warning("engines %s come back with the checkpoint's weights: none serves the pushed weights v%s "
                        "and no trainer can push them again; their samples carry their own weight_version until "
                        "the next push", urls, self._pushed_version)
            for url in urls:
                self._add_to_router(url)
            self._awaiting_push.clear()
            return
        log.warning("no engine in the router serves the pushed weights v%s: asking the trainers to push the weights "
                    "they hold to %s", self._pushed_version, urls)
        self._repush.set()

    def repush_request(self, wait: float) -> list[str]:
        """The URLs of the engines waiting for the trainers to push again, once the fleet asks for that push
        (within ``wait`` seconds); else ``[]``."""
        if not self._repush.wait(wait):
            return []
        with self._lock:
            self._repush.clear()
            return [self.engines[j][1] for j in sorted(self._awaiting_push)]

    def repushed(self, version: str) -> None:
        """The trainers pushed the weights of ``version`` to the engines of ``repush_request``: those serving it
        go back into the router (one that still does not waits for the next push). A version older than the last
        pushed one (a regular push overtook this one) changes nothing."""
        with self._lock:
            if self._pushed_version is not None and int(version) < int(self._pushed_version):
                return
            self.admit_pushed(version, push_again=False)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.check_timeout + 10)
        with self._router_lock:
            self.router.stop()
        for handle, _ in self.engines:
            self.lifecycle.shutdown(handle)


def _engine_gone(exc: BaseException) -> bool:
    """The engine died or its connection broke (a fault to repair), as opposed to a bad request."""
    from ray.exceptions import RayActorError

    return isinstance(exc, (RayActorError, OSError))

