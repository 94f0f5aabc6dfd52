"""slime-core shim of ``slime.utils.async_utils``: ``run(coro)`` runs a coroutine on one background event loop
thread and waits for its result, as slime's does (so sync rollout functions can drive async generate code)."""

from __future__ import annotations

import asyncio
import threading

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_async_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-shim-async-loop", daemon=True).start()
    return _loop


def run(coro):
    """Run ``coro`` on the background loop; block until it finishes and return its result."""
    return asyncio.run_coroutine_threadsafe(coro, get_async_loop()).result()


__all__ = ["run", "get_async_loop"]
