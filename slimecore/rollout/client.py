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
import logging
import random
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

log = logging.getLogger("slimecore.client")

T = TypeVar("T")


class EngineError(RuntimeError):
    """An engine or the router answered with an error, or could not be reached after retries."""


class EngineUnreachable(EngineError):
    """No answer but connection errors, timeouts or 5xx, after every retry."""


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

    def __init__(self, router_url: str, tokenizer: Any = None, timeout: float = 600, max_retries: int = 5,
                 api_key: str | None = None):
        self.url = router_url.rstrip("/")
        # the run's key (multi-node runs): sent as a bearer token to the router and to every engine
        self.api_key = api_key
        self.policy_version = 0  # the weight version the engines serve; the manager sets it after each update
        self.tokenizer = tokenizer
        self.timeout, self.max_retries = timeout, max_retries
        self.retries = 0  # requests sent again after a connection error or a 5xx, since the client was made
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        for dead in [other for other in self._sessions if other.is_closed()]:
            del self._sessions[dead]  # its loop is gone, so the session can no longer be closed cleanly
        session = self._sessions.get(loop)
        if session is None or session.closed:
            # limit=0: the rollout caps concurrency itself (a semaphore); the pool must not add a second cap
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                            connector=aiohttp.TCPConnector(limit=0), headers=headers)
            self._sessions[loop] = session
        return session

    async def _request(self, method: str, url: str, body: Any = None, retries: int | None = None,
                       timeout: float | None = None, headers: dict | None = None) -> Any:
        """The decoded JSON of a 2xx answer (its text if it is not JSON, as /flush_cache answers; None when
        empty); see the module docstring for errors."""
        retries = self.max_retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            try:
                options = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
                async with self._session().request(method, url, json=body, headers=headers, **options) as response:
                    text = await response.text()
                    if response.status < 300:
                        return _decode(text)
                    if response.status < 500:
                        raise EngineError(f"{method} {url} -> HTTP {response.status}: {text[:500]}")
                    last = f"HTTP {response.status}: {text[:300]}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < retries:
                self.retries += 1
                await asyncio.sleep(min(10.0, 0.2 * 2**attempt) * (1 + random.random() * 0.1))
        raise EngineUnreachable(f"{method} {url} failed after {retries + 1} attempts; last error: {last}")

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
            busy = dict(zip(urls, await asyncio.gather(*(self._abort_on(u) for u in urls))))
            if not any(busy.values()):
                return
            if loop.time() > deadline:
                raise EngineError(f"engines still busy {timeout:.0f}s after abort_all: {busy}")
            await asyncio.sleep(poll)

    async def _abort_on(self, url: str, timeout: float = 10) -> int:
        """Abort everything on one worker; return how many requests it still runs or queues. A worker that
        does not answer within ``timeout`` (dead or hung) counts as idle: the requests it held fail with it,
        and the fault monitor (slimecore.engines.fleet) replaces it."""
        try:
            await self._request("POST", url + "/abort_request", {"abort_all": True}, retries=0, timeout=timeout)
            data = await self._request("GET", url + "/v1/loads?include=core", retries=0, timeout=timeout)
        except EngineUnreachable:
            return 0
        return sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in data["loads"])

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
                except EngineUnreachable:  # died meanwhile: the fault monitor restarts it
                    break
                except EngineError:
                    if loop.time() > deadline:
                        raise
                await asyncio.sleep(poll)

    async def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Every engine reloads its weights from the HF safetensors directory ``path``."""
        from slimecore.engines.weight_sync import disk_body

        results = await self.on_every_engine("/update_weights_from_disk", disk_body(path, weight_version))
        failed = [(u, r) for u, r in results.items() if not r.get("success")]
        if failed:
            raise EngineError(f"update_weights_from_disk failed on {failed}")

    async def on_every_engine(self, path: str, body: Any = None) -> dict[str, Any]:
        """``POST path`` to every engine at once (the router does not forward control calls); URL -> answer."""
        urls = await self.worker_urls()
        answers = await asyncio.gather(*(self._request("POST", u + path, body, retries=0) for u in urls),
                                       return_exceptions=True)
        for url, answer in zip(urls, answers):
            if isinstance(answer, EngineUnreachable):  # it died: the fault monitor takes it out and restarts it
                log.warning("POST %s%s: engine unreachable, skipped (%s)", url, path, answer)
            elif isinstance(answer, BaseException):
                raise answer
        return {url: answer for url, answer in zip(urls, answers) if not isinstance(answer, EngineUnreachable)}

    async def pause_for_update(self) -> None:
        """Before a weight update, as slime does: ``/pause_generation`` (in-flight requests end as aborted,
        new ones wait), then ``/flush_cache`` once every engine is idle."""
        await self.on_every_engine("/pause_generation", {})
        await self.flush_cache()

    async def continue_generation(self) -> None:
        await self.on_every_engine("/continue_generation", {})

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
