"""The one rollout client: what generate hooks use to talk to the engines (through the router).

It speaks SGLang's native API, so it serves the embedded CPU engine and a real SGLang server alike.
Plugins never build URLs themselves::

    out = await client.generate(input_ids=sample.tokens, sampling_params={"max_new_tokens": 64})
    entries = out["meta_info"]["output_token_logprobs"]  # [[logprob, token_id, None], ...]
    tokens, logprobs = [e[1] for e in entries], [e[0] for e in entries]
    out["meta_info"]["finish_reason"]["type"]  # "stop" | "length" | "abort"

Errors: a 4xx (a bad request) raises :class:`EngineError` at once with the server's message; connection
errors and 5xx are retried with exponential backoff, then raise :class:`EngineError` naming the URL
and the last status. One aiohttp session is kept per event loop, so the client works from any loop.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")


class EngineError(RuntimeError):
    """An engine or the router answered with an error, or could not be reached after retries."""


def _decode(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class RolloutClient:
    """Async client of the router (``/generate``, ``/workers``) and of each worker (abort, load, flush).

    ``timeout`` bounds one HTTP call in seconds; ``max_retries`` is the number of retries after the first
    attempt for connection errors and 5xx. ``tokenizer`` (optional) is the rollout's tokenizer, kept
    here for hooks that want to encode or decode next to their calls."""

    def __init__(self, router_url: str, tokenizer: Any = None, timeout: float = 600, max_retries: int = 5):
        self.url = router_url.rstrip("/")
        self.policy_version = 0  # the weight version the engines serve; the manager sets it after each update
        self.tokenizer = tokenizer
        self.timeout, self.max_retries = timeout, max_retries
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        for dead in [other for other in self._sessions if other.is_closed()]:
            del self._sessions[dead]  # its loop is gone, so the session can no longer be closed cleanly
        session = self._sessions.get(loop)
        if session is None or session.closed:
            # limit=0: the rollout caps concurrency itself (a semaphore); the pool must not add a second cap
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                            connector=aiohttp.TCPConnector(limit=0))
            self._sessions[loop] = session
        return session

    async def _request(self, method: str, url: str, body: Any = None, retries: int | None = None,
                       headers: dict | None = None) -> Any:
        """The decoded JSON of a 2xx answer (its text if it is not JSON, as /flush_cache answers; None when
        empty); see the module docstring for errors."""
        retries = self.max_retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            try:
                async with self._session().request(method, url, json=body, headers=headers) as response:
                    text = await response.text()
                    if response.status < 300:
                        return _decode(text)
                    if response.status < 500:
                        raise EngineError(f"{method} {url} -> HTTP {response.status}: {text[:500]}")
                    last = f"HTTP {response.status}: {text[:300]}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < retries:
                await asyncio.sleep(min(10.0, 0.2 * 2**attempt) * (1 + random.random() * 0.1))
        raise EngineError(f"{method} {url} failed after {retries + 1} attempts; last error: {last}")

    async def generate(self, input_ids: Sequence[int] | None = None, sampling_params: dict | None = None, *,
                       text: str | None = None, return_logprob: bool = True, rid: str | None = None,
                       routing_key: str | None = None, **extra: Any) -> dict:
        """``POST /generate`` through the router with ``input_ids`` (or ``text``); returns SGLang's response:
        ``text``, ``output_ids`` and ``meta_info`` (``finish_reason``, ``weight_version``, and with
        ``return_logprob`` the ``output_token_logprobs`` aligned 1:1 with ``output_ids``). ``extra``
        top-level fields (for example ``logprob_start_len``) are sent as given. ``routing_key`` (an agent
        session's id) goes out as the router's ``X-SMG-Routing-Key`` header: under ``--policy manual`` the
        router keeps every request with one key on one engine (its prefix cache)."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        body: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob,
                                **extra}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        headers = {"X-SMG-Routing-Key": routing_key} if routing_key else None
        return await self._request("POST", self.url + "/generate", body, headers=headers)

    async def worker_urls(self) -> list[str]:
        """The engines registered with the router (``GET /workers``)."""
        data = await self._request("GET", self.url + "/workers")
        workers = data.get("workers", []) if isinstance(data, dict) else data
        return [w["url"] if isinstance(w, dict) else w for w in workers]

    async def abort_all(self, timeout: float = 60, poll: float = 0.05) -> None:
        """Abort every request on every engine and return once all report 0 running + waiting.

        The router does not forward aborts, so this posts ``/abort_request {"abort_all": true}`` to each
        worker, and repeats it (requests may still be on their way) until ``/v1/loads`` shows them idle.
        Aborted ``generate`` calls return normally with ``finish_reason.type == "abort"`` and their
        partial output."""
        urls = await self.worker_urls()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await asyncio.gather(*(self._request("POST", u + "/abort_request", {"abort_all": True}) for u in urls))
            loads = await asyncio.gather(*(self._request("GET", u + "/v1/loads?include=core") for u in urls))
            busy = {u: sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in data["loads"])
                    for u, data in zip(urls, loads)}
            if not any(busy.values()):
                return
            if loop.time() > deadline:
                raise EngineError(f"engines still busy {timeout:.0f}s after abort_all: {busy}")
            await asyncio.sleep(poll)

    async def flush_cache(self, timeout: float = 60, poll: float = 0.5) -> None:
        """Flush every engine's cache. An engine answers 400 while requests run; keep asking until it is
        idle, as slime does, up to ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for url in await self.worker_urls():
            while True:
                try:
                    await self._request("POST", url + "/flush_cache", retries=0)
                    break
                except EngineError:
                    if loop.time() > deadline:
                        raise
                await asyncio.sleep(poll)

    async def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Every engine reloads its weights from the HF safetensors directory ``path``."""
        urls = await self.worker_urls()
        results = await asyncio.gather(*(self._request("POST", u + "/update_weights_from_disk",
                                                       {"model_path": path, "weight_version": weight_version},
                                                       retries=0) for u in urls))
        failed = [(u, r) for u, r in zip(urls, results) if not r.get("success")]
        if failed:
            raise EngineError(f"update_weights_from_disk failed on {failed}")

    async def close(self) -> None:
        """Close this event loop's session (the client stays usable: a later call opens a new one)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of this client from synchronous code, in a fresh event loop, closing the
        session it opened: ``client.run_sync(client.generate([1, 2], {"max_new_tokens": 4}))``."""

        async def main() -> T:
            try:
                return await coro
            finally:
                await self.close()

        return asyncio.run(main())
