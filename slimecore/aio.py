"""Event loops for the processes that serve or send HTTP (the embedded engine, the rollout client, the agent
session server): uvloop's where it is installed, asyncio's otherwise. The tiny vs-TRL rollout (64 ``/generate``
calls through the router) took 68 ms on uvloop against 78 ms on asyncio's loop, most of it in answering the
64 requests at the end of the wave."""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # e.g. on Windows, where uvloop does not install
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def gather(*awaitables):
    """``asyncio.gather``'s results; on the first failure the other awaitables are cancelled and waited for (their
    own errors retrieved) before it is raised, so a failed step leaves nothing running and no "Task exception was
    never retrieved" at exit."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await cancel(tasks)
        raise


async def cancel(tasks) -> None:
    """Cancel ``tasks`` and wait for them to end, their exceptions retrieved."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
