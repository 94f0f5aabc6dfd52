"""What the rollout waits on, said while it waits and when a deadline passes, even when its event loop is blocked.

A ``time.sleep`` (or any blocking call) inside an ``async`` hook stops the rollout's event loop from turning, and
with it every ``asyncio`` timeout: ``--rollout-timeout`` would never fire. So the rollout manager runs its event
loop on a thread of its own (``LoopThread``) and waits for each step from the calling thread, with the deadline
kept there; and a watchdog thread posts a heartbeat to the loop every second:

- the loop has not turned for ``STALL_SECONDS``: it logs, once per stall, the plugin, hook and sample being
  called and the line of the plugin's code the loop is stuck in;
- hook calls have been waited on for ``REPORT_EVERY`` seconds: it logs the oldest, once per ``REPORT_EVERY``
  (a reward service that never answers is said every minute, not silent until ``--reward-timeout``);
- a deadline passes: ``run_until_complete`` raises ``RolloutTimeoutError`` naming what was in flight (and where
  the loop was stuck) at that moment, instead of ``asyncio``'s empty ``TimeoutError``.

The hooks in flight are recorded by ``slimecore.plugins.Hooks``' guard (``waiting``), around every awaited
hook call, with the plugin, the hook and the sample or group the call is for. The module imports nothing of
slime-core, so the plugin loader, below the rollout, may use it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("slimecore.rollout")
STALL_SECONDS = 5.0
REPORT_EVERY = 60.0
SHOWN = 3  # calls named in one message


class RolloutTimeoutError(TimeoutError):
    """A rollout step (or another wait on the rollout's event loop) passed its deadline; the message names what it
    was waiting on."""


@dataclass
class Call:
    plugin: str
    hook: str
    subject: str  # "sample 3", "a group of 4 samples (first sample 8)", "" when the hook has no sample
    started: float
    parent: int | None = None  # the hook call this one was made from (slime_reward from within slime_rollout)

    def text(self, now: float) -> str:
        return f"plugin {self.plugin!r} {self.hook}{' for ' + self.subject if self.subject else ''} " \
               f"({now - self.started:.0f} s)"


_calls: dict[int, Call] = {}
_ids = itertools.count()
_enclosing: contextvars.ContextVar[int | None] = contextvars.ContextVar("slimecore_hook_call", default=None)


def subject(args: dict) -> str:
    """What a hook call is for, from its arguments: the sample, or the group of samples."""
    sample, samples = args.get("sample"), args.get("samples")
    if sample is not None:
        return f"sample {getattr(sample, 'index', '?')}"
    if samples:
        return f"a group of {len(samples)} samples (first sample {getattr(samples[0], 'index', '?')})"
    return ""


@contextlib.contextmanager
def waiting(plugin: str, hook: str, args: dict):
    """Record an awaited hook call while it runs (the watchdog and a timeout name it)."""
    key = next(_ids)
    _calls[key] = Call(plugin, hook, subject(args), time.monotonic(), _enclosing.get())
    token = _enclosing.set(key)  # tasks started inside inherit it (asyncio copies the context)
    try:
        yield
    finally:
        _enclosing.reset(token)
        _calls.pop(key, None)


def in_flight(now: float | None = None) -> str:
    """The longest-running hook calls that wait on no other hook call (a reward, not the rollout it runs in),
    oldest first, as one phrase ("" when none)."""
    now = time.monotonic() if now is None else now
    running = list(_calls.items())
    enclosing = {call.parent for _, call in running}
    calls = sorted((call for key, call in running if key not in enclosing), key=lambda call: call.started)
    if not calls:
        return ""
    more = f" and {len(calls) - SHOWN} more" if len(calls) > SHOWN else ""
    return "; ".join(c.text(now) for c in calls[:SHOWN]) + more


def stuck_at(thread: threading.Thread) -> str:
    """The innermost line outside the core and the standard library that ``thread`` runs now: where a blocking
    call in a plugin holds the event loop (``path:line in function``); else the innermost line."""
    frame = sys._current_frames().get(thread.ident)
    innermost, own = None, None
    core = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the slimecore package
    stdlib = os.path.dirname(os.__file__)
    while frame is not None:
        path = frame.f_code.co_filename
        where = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        innermost = innermost or where
        if own is None and not path.startswith((core, stdlib)) and "site-packages" not in path \
                and not path.startswith("<"):
            own = where
        frame = frame.f_back
    return own or innermost or "an unknown place"


class LoopThread:
    """An event loop running on a thread of its own, with the watchdog. ``run_until_complete(coro, timeout)``
    runs ``coro`` on it and waits from the calling thread, so the deadline holds when the loop is blocked."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "rollout", stall: float = STALL_SECONDS,
                 report_every: float = REPORT_EVERY):
        self.loop, self.name, self.stall, self.report_every = loop, name, stall, report_every
        self.turned = time.monotonic()  # when the loop last ran the heartbeat
        self._stop = threading.Event()
        self.thread = threading.Thread(target=loop.run_forever, name=f"slimecore-{name}-loop", daemon=True)
        self.thread.start()
        self._watch = threading.Thread(target=self._watchdog, name=f"slimecore-{name}-watchdog", daemon=True)
        self._watch.start()

    def run_until_complete(self, coro, timeout: float | None = None, what: str = "the call"):
        """``coro``'s result; past ``timeout`` seconds a ``RolloutTimeoutError`` saying what was in flight
        (``what`` names the wait, e.g. "rollout 3 (--rollout-timeout 20 s)"), and ``coro`` is cancelled."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            message = f"{what} did not finish within {timeout:g} s: {self.describe()}"
            future.cancel()  # takes effect when the loop turns again
            raise RolloutTimeoutError(message) from None

    def blocked_for(self) -> float:
        return time.monotonic() - self.turned

    def blocked(self) -> bool:
        """Whether the loop has not turned for ``stall`` seconds (a hook holds it)."""
        return self.blocked_for() >= self.stall

    def describe(self) -> str:
        """What the loop waits on now, and where it is stuck when it has not turned for ``stall`` seconds."""
        calls = in_flight()
        text = f"waiting on {calls}" if calls else "no hook call in flight (waiting on the engines or the data)"
        if self.blocked():
            text += (f". The event loop has not turned for {self.blocked_for():.0f} s: it is blocked at "
                     f"{stuck_at(self.thread)}. A blocking call (time.sleep, requests, a CPU-bound loop) inside "
                     "an async hook stops every timeout; use await asyncio.sleep / aiohttp, or "
                     "await asyncio.to_thread(fn, ...) for blocking work")
        return text

    def _beat(self) -> None:
        self.turned = time.monotonic()

    def _watchdog(self) -> None:
        stalled, last_report = False, time.monotonic()
        while not self._stop.wait(1.0):
            if self.loop.is_closed():
                return
            self.loop.call_soon_threadsafe(self._beat)
            if self.blocked() and not stalled:
                log.warning("%s: %s", self.name, self.describe())
            stalled = self.blocked()
            now = time.monotonic()  # one line per period, naming the oldest calls, however many are waiting
            oldest = min((call.started for call in list(_calls.values())), default=now)
            if now - oldest >= self.report_every and now - last_report >= self.report_every:
                last_report = now
                log.warning("%s: still waiting on %s", self.name, in_flight(now))

    def close(self) -> None:
        """Stop the watchdog and the loop (a loop blocked by a hook is left to its daemon thread)."""
        self._stop.set()
        if not self.blocked():  # what is still pending (a step cancelled at its deadline) ends first
            concurrent.futures.wait([asyncio.run_coroutine_threadsafe(_cancel_pending(), self.loop)], timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            if not self.thread.is_alive():
                self.loop.close()


async def _cancel_pending() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
