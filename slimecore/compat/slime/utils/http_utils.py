"""slime-core shim of ``slime.utils.http_utils``: ``post`` / ``get`` as slime's (JSON in and out; ``post`` retries
up to ``max_retries`` times, one second apart), on one aiohttp session per event loop. In a slime-core run,
``args.sglang_router_ip`` / ``args.sglang_router_port`` are the run's router, which serves SGLang's API."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

log = logging.getLogger("slime.utils.http_utils")
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = _sessions[loop] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    return session


def _decode(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def post(url, payload, max_retries=60, headers=None):
    for attempt in range(1, max_retries + 1):
        try:
            async with _session().post(url, json=payload or {}, headers=headers) as response:
                response.raise_for_status()
                return _decode(await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.info("Error: %s, retrying... (attempt %d/%d, url=%s)", exc, attempt, max_retries, url)
            if attempt >= max_retries:
                raise
            await asyncio.sleep(1)


async def get(url):
    async with _session().get(url) as response:
        response.raise_for_status()
        return _decode(await response.text())


__all__ = ["post", "get"]
