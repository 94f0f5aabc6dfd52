"""The embedded engine's scheduler: the request queues, pause and abort, and the decode waves on one thread.

Batching (continuous, on one scheduler thread): the scheduler collects the waiting requests (up to
``max_batch_size``, 64 by default; it starts once no request came for a few milliseconds), prefills them
together and decodes step by step (:mod:`slimecore.engines.embedded.runner`). A finished row leaves the batch
at once (its KV rows are dropped); requests that arrive meanwhile are prefilled on their own and join the
running batch. Joining stops while a weight update waits, so updates are never starved.

:class:`Scheduler` is the part of :class:`~slimecore.engines.embedded.server.EmbeddedServer` that owns the
queues (``_cond`` guards them: ``_queue``, ``_held``, ``_running``, ``_inflight``), the pause gate
(``unpaused``) and the wave loop; a wave runs under ``_weights_lock``
(:mod:`slimecore.engines.embedded.weights`).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from slimecore.engines.embedded.request import ABORTED_WAITING, Request
from slimecore.engines.http import BadRequest

log = logging.getLogger("slimecore.engine")


class _PauseGate(threading.Event):
    """``server.unpaused``: set while generation runs. Setting it wakes the scheduler, which then admits
    the requests held while paused."""

    def __init__(self, on_change):
        super().__init__()
        super().set()
        self._on_change = on_change

    def set(self) -> None:
        super().set()
        self._on_change()

    def clear(self) -> None:
        super().clear()
        self._on_change()


class Scheduler:
    """Queue, pause, abort and run the requests; ``_scheduler`` is the scheduler thread's body."""

    def submit(self, request: Request) -> Request:
        """Queue a request (held aside while paused); ``request.done`` is set when its response is ready."""
        self.submit_all([request])
        return request

    def submit_all(self, requests: list[Request]) -> None:
        """Queue a batch's requests together, or none of them when a rid is already in flight or repeated."""
        with self._cond:
            seen = set()
            for request in requests:
                if request.rid in self._inflight or request.rid in seen:
                    raise BadRequest(f"Duplicate request ID detected: {request.rid}")
                seen.add(request.rid)
            for request in requests:
                self._inflight[request.rid] = request
            (self._queue if self.unpaused.is_set() else self._held).extend(requests)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """SGLang's /abort_request: every request in the scheduler, or, when ``rid`` is in flight, every
        request whose rid starts with it. Waiting requests finish at once, running ones after the current
        decode step, with their partial output. Requests held by a pause are not in the scheduler."""
        with self._cond:
            if abort_all:
                targets = [*self._queue, *self._running]
            elif rid and rid in self._inflight:
                targets = [r for r in (*self._queue, *self._running) if r.rid.startswith(rid)]
            else:
                targets = []
            for req in targets:
                if req in self._running:
                    req.aborted = True
                else:
                    self._queue.remove(req)
                    self._finish(req, ABORTED_WAITING)
            self._cond.notify_all()

    def loads(self) -> dict:
        """Scheduler load, as /v1/loads and /get_load report it."""
        with self._cond:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._queue)}

    def _notify(self) -> None:
        with self._cond:
            if self.unpaused.is_set() and self._held:
                self._queue.extend(self._held)
                self._held.clear()
            self._cond.notify_all()

    def _finish(self, req: Request, reason: dict) -> None:
        with self._cond:
            req.finish_reason = reason
            self._inflight.pop(req.rid, None)
            if req in self._running:  # a batch that others keep joining may outlive many requests
                self._running.remove(req)
            req.done.set()
        if req.on_done is not None:
            req.on_done()

    def _take(self, limit: int) -> list[Request]:
        """Move up to ``limit`` waiting requests into the running set (caller holds ``_cond``)."""
        taken = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
        self._running.extend(taken)
        return taken

    def _scheduler(self) -> None:
        torch.set_num_threads(self.num_threads)  # the intra-op threads this thread's forwards use, whatever ran before
        while not self._stop.is_set():
            with self._cond:
                if not self._cond.wait_for(lambda: self._stop.is_set() or (self._queue and self.unpaused.is_set()),
                                           timeout=1.0) or self._stop.is_set():
                    continue
                # the requests of one rollout arrive over a few milliseconds: prefill them together. The wave
                # starts when the batch is full, when no request came for ``gather_quiet`` or after
                # ``gather_window``; later ones join the running batch
                deadline = time.monotonic() + self.gather_window
                while len(self._queue) < self.max_batch_size and (left := deadline - time.monotonic()) > 0:
                    waiting = len(self._queue)
                    self._cond.wait(min(left, self.gather_quiet))
                    if len(self._queue) == waiting:
                        break
                wave = self._take(self.max_batch_size)
            try:
                with self._weights_lock:
                    self._run_wave(wave)
            except Exception as exc:  # answer the wave's requests instead of leaving their callers hanging
                log.exception("decode wave failed")
                for req in list(self._running):
                    self._finish(req, {"type": "abort", "message": f"engine error: {exc}", "status_code": 500,
                                       "err_type": type(exc).__name__})

    def _admit(self, reqs: list[Request]) -> list[Request]:
        """Answer the requests that need no decoding (aborted while queued, max_new_tokens 0); return the rest."""
        active = []
        for req in reqs:
            if req.aborted:
                self._finish(req, ABORTED_WAITING)
            elif req.params["max_new_tokens"] == 0:
                if req.logprob_start_len >= 0:
                    self._prefill([req])  # a prompt-only request (e.g. a teacher's log-probs)
                self._finish(req, {"type": "length", "length": 0})
            else:
                active.append(req)
        return active

    @torch.inference_mode()
    def _run_wave(self, wave: list[Request]) -> None:
        self.stats["waves"] += 1
        self.stats["last_wave_size"] = len(wave)
        rows, batch = [], None
        pending = self._admit(wave)
        while rows or pending:
            if pending:
                fresh = self._prefill(pending)
                if rows:
                    batch.extend(fresh)
                else:
                    batch = fresh
                rows += pending
                self.stats["max_wave_size"] = max(self.stats["max_wave_size"], len(rows))
            tokens = self._sample(rows, batch.logits)
            for req, token in zip(rows, tokens):
                self._advance(req, token)
            keep = [i for i, r in enumerate(rows) if not r.done.is_set()]
            if len(keep) < len(rows):
                rows, tokens = [rows[i] for i in keep], [tokens[i] for i in keep]
                if keep:
                    batch.select(keep)
            if rows:
                self._decode_step(batch, tokens)
                if self.routes:
                    self.routes.keep(rows)
            pending = self._admit(self._joiners(len(rows)))

    def _joiners(self, running: int) -> list[Request]:
        """Waiting requests that join the running batch (not while paused or a weight update waits)."""
        if self._update_waiting.is_set() or not self.unpaused.is_set() or self._stop.is_set():
            return []
        with self._cond:
            joined = self._take(self.max_batch_size - running)
        self.stats["joined"] += len(joined)
        return joined
