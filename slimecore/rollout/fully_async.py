"""Fully-async rollout (``--fully-async``): one background worker per data source keeps generating across steps.

Generation never waits for training: the worker keeps ``--fully-async-groups`` groups queued or in flight while
the manager serves steps and weight updates, and each step takes the first ``--rollout-batch-size`` finished
groups no staler than ``--max-staleness`` weight versions. The built-in ``slime_rollout`` calls
``fully_async_step``; ``stop_workers`` ends every worker at shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time

from slimecore import aio
from slimecore.rollout.groups import GroupRunner, concurrency, warn_if_starving
from slimecore.types import RolloutOutput, Sample, Status


class BackgroundRollout:
    """Keeps up to ``--fully-async-groups`` groups queued or in flight on its own thread and event loop,
    while the manager serves steps and weight updates. Finished groups pass the group filter and wait in
    a queue; a step takes them in completion order. Requests started before a weight update finish on
    the old weights (the engine loads new weights between decode waves), so each sample records the
    versions that produced it.

    Everything that touches the data source holds ``lock``; ``state()`` is the data source's state with
    every group still held here put back into the buffer (responses cleared), so a checkpoint loses none.
    """

    def __init__(self, config, data_source, client, sample_hooks):
        self.config, self.data_source, self.client, self.sample_hooks = config, data_source, client, sample_hooks
        self.capacity = config.fully_async_groups or config.rollout_batch_size
        self.lock = threading.Lock()
        self.finished: queue.Queue = queue.Queue()
        # id(group) -> a copy of the group as it was submitted, for every group in flight or finished and not
        # yet taken (the copy, not the live samples, goes into checkpoints: those may be mid-update)
        self.held: dict[int, list[Sample]] = {}
        self.drops: collections.Counter = collections.Counter()
        self.rollout_id = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="slimecore-fully-async", daemon=True)
        self._thread.start()

    # -- the worker thread -------------------------------------------------------------------------
    def _main(self) -> None:
        loop = aio.new_event_loop()
        try:
            loop.run_until_complete(self._produce())
        except BaseException as exc:  # surfaced to the next step by take()
            self.error = exc
            self.finished.put(None)
        finally:
            loop.run_until_complete(self.client.close())  # this loop's session only
            loop.close()

    async def _produce(self) -> None:
        runner = GroupRunner(self.config, self.client, self.sample_hooks, self.rollout_id, False,
                             asyncio.Semaphore(concurrency(self.config)))
        tasks: dict[asyncio.Task, list[Sample]] = {}
        while not self._stop.is_set():
            while len(self.held) < self.capacity:
                with self.lock:
                    group = self.data_source.get_samples(1)[0]
                self.held[id(group)] = [Sample.from_dict(sample.to_dict()) for sample in group]
                runner.rollout_id = self.rollout_id
                tasks[asyncio.ensure_future(runner.run(group))] = group
            if not tasks:  # everything held is finished and queued: wait for a step to take some
                await asyncio.sleep(0.05)
                continue
            done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = tasks.pop(task)
                task.result()  # a generate hook that raised stops the worker; take() re-raises it
                if any(s.status == Status.ABORTED for s in group):
                    self.give_back(group, keep_partial=self.config.partial_rollout)
                    continue
                verdict, _ = self.sample_hooks.filter_group(config=self.config, samples=group)
                if verdict.keep:
                    self.finished.put(group)
                else:
                    self.drops[verdict.reason or "filtered"] += 1
                    del self.held[id(group)]
                    warn_if_starving(self.drops, self.finished.qsize(), self.config.rollout_batch_size)
        if tasks:  # shutting down: abort what runs and return it to the buffer
            await self.client.abort_all()
            await asyncio.gather(*tasks, return_exceptions=True)
            for group in tasks.values():
                self.give_back(group, keep_partial=self.config.partial_rollout)

    # -- called from the manager's thread ----------------------------------------------------------
    def take(self, timeout: float) -> list[Sample]:
        try:
            group = self.finished.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the fully-async rollout finished no group in {timeout:.0f}s (--rollout-timeout); "
                               "are the engines alive and is the group filter rejecting everything?") from None
        if group is None:
            raise RuntimeError(f"the fully-async rollout worker stopped: {self.error!r}") from self.error
        return group

    def give_back(self, group: list[Sample], keep_partial: bool = False) -> None:
        """Return a group to the data source's buffer (to be generated again, or continued)."""
        for sample in group:
            if not keep_partial:
                sample.reset_response()
            elif sample.status == Status.ABORTED:
                sample.status = Status.PENDING
        with self.lock:
            self.held.pop(id(group), None)
            self.data_source.add_samples([group])

    def release(self, group: list[Sample]) -> None:
        self.held.pop(id(group), None)

    def state(self) -> dict:
        with self.lock:
            state = self.data_source.state_dict()
            held = [list(g) for g in self.held.values()]
        for group in held:
            for sample in group:
                sample.reset_response()
            state["buffer"].append([sample.to_dict() for sample in group])
        return state

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.config.rollout_timeout)


_WORKERS: dict[int, BackgroundRollout] = {}  # by id(data source): one worker each, across steps


async def fully_async_step(config, rollout_id: int, data_source, client, sample_hooks) -> RolloutOutput:
    """One step from the background worker: the first ``--rollout-batch-size`` finished groups whose
    samples the trainer will see at most ``--max-staleness`` versions old; older groups go back to the
    buffer and are generated again (``rollout/stale_groups_regenerated``)."""
    worker = _WORKERS.get(id(data_source))
    if worker is None:
        worker = _WORKERS[id(data_source)] = BackgroundRollout(config, data_source, client, sample_hooks)
    worker.rollout_id = rollout_id
    # the async loop trains this step after one more update than the engines serve now
    train_version = client.policy_version + 1
    accepted, stale, lags = [], 0, []
    loop = asyncio.get_running_loop()
    wait_start = time.perf_counter()
    while len(accepted) < config.rollout_batch_size:
        group = await loop.run_in_executor(None, worker.take, config.rollout_timeout)
        versions = [int(v) for s in group for v in s.weight_versions if v not in (None, "default")]
        lag = train_version - min(versions) if versions else 0
        if lag > config.max_staleness:
            stale += 1
            worker.give_back(group)
            continue
        worker.release(group)
        lags.append(lag)
        accepted.append(group)
    drops, worker.drops = worker.drops, collections.Counter()
    metrics = {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in drops.items()}
    metrics.update({"rollout/stale_groups_regenerated": float(stale), "rollout/async_max_lag": float(max(lags)),
                    "rollout/async_queue_wait_time": time.perf_counter() - wait_start,
                    "rollout/async_groups_ready": float(worker.finished.qsize())})
    accepted.sort(key=lambda g: g[0].index if g[0].index is not None else 0)
    return RolloutOutput(accepted, metrics, data_state=worker.state())


def stop_workers() -> None:
    """Stop every background worker of this process (each returns the groups it holds to its data source)."""
    for key in list(_WORKERS):
        _WORKERS.pop(key).stop()
