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
import contextvars
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


_SHARED_REQUESTS: contextvars.ContextVar[SharedRequests | None] = contextvars.ContextVar("slimecore_shared_requests",
                                                                                        default=None)


class SharedRequests:
    """``generate`` calls made together share one HTTP request (SGLang's batch form of ``/generate``).

    Inside ``with SharedRequests():``, tasks started there send their ``client.generate`` calls through it: the
    calls that arrive while the event loop still has other work ready (the samples of one prompt group, whose
    hooks start together) and that have the same sampling params and ``return_logprob`` go out as one request
    with ``input_ids`` a list of prompts; each caller gets its own response, as if it had sent its own request.
    A request goes out once a whole pass of the event loop added nothing to it, so a call made alone waits
    for no one. Calls with ``rid``, ``routing_key``, ``text`` or other top-level fields are sent on their own.
    Each HTTP call costs CPU in the client, the router and the engine (~0.2 ms in this client alone on a 2-core
    machine), as much per call whatever its size. Errors (4xx, unreachable after retries) reach every caller of
    the shared request; a caller that gives up (a timeout) leaves the others waiting, and a request whose
    callers all gave up is cancelled."""

    def __init__(self):
        self._pending: dict[tuple, list] = {}  # (client, params, return_logprob) -> [(input_ids, future), ...]
        self._sending: set[asyncio.Task] = set()
        self._token = None

    def __enter__(self) -> SharedRequests:
        self._token = _SHARED_REQUESTS.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _SHARED_REQUESTS.reset(self._token)

    async def generate(self, client: RolloutClient, body: dict) -> dict:
        key = (client, json.dumps(body["sampling_params"], sort_keys=True), body["return_logprob"])
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = self._pending.setdefault(key, [])
        waiting.append((body["input_ids"], future))
        if len(waiting) == 1:
            loop.call_soon(self._send_when_quiet, key, 1)
        return await future

    def _send_when_quiet(self, key: tuple, seen: int) -> None:
        waiting = self._pending[key]
        if len(waiting) > seen:  # still growing: wait one more pass of the loop
            asyncio.get_running_loop().call_soon(self._send_when_quiet, key, len(waiting))
            return
        del self._pending[key]
        task = asyncio.ensure_future(self._send(key, waiting))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        futures = [future for _, future in waiting]

        def caller_done(_) -> None:
            if not task.done() and all(f.cancelled() for f in futures):
                task.cancel()

        for future in futures:
            future.add_done_callback(caller_done)

    @staticmethod
    async def _send(key: tuple, waiting: list) -> None:
        client, params, return_logprob = key
        live = [(ids, future) for ids, future in waiting if not future.done()]  # a caller may have given up
        if not live:
            return
        body = {"sampling_params": json.loads(params), "return_logprob": return_logprob,
                "input_ids": live[0][0] if len(live) == 1 else [ids for ids, _ in live], **client.asks}
        try:
            answer = await client._request("POST", client.url + "/generate", body)
            answers = [answer] if len(live) == 1 else answer
            if not isinstance(answers, list) or len(answers) != len(live):
                raise EngineError(f"POST {client.url}/generate: a batch of {len(live)} prompts was answered with "
                                  f"{type(answer).__name__} of {len(answers) if isinstance(answers, list) else 1}")
        except asyncio.CancelledError:
            for _, future in live:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 -- every caller gets the error
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), one in zip(live, answers):
            if not future.done():
                future.set_result(one)


class RolloutClient:
    """Async client of the router (``/generate``, ``/workers``) and of each worker (abort, load, flush).

    ``timeout`` bounds one HTTP call in seconds; ``max_retries`` is the number of retries after the first
    attempt for connection errors and 5xx. ``tokenizer`` (optional) is the rollout's tokenizer, kept
    here for hooks that want to encode or decode next to their calls. ``routed_experts`` (the rollout manager
    sets it with ``--use-rollout-routing-replay``: the model's ``slimecore.routing_replay.RoutingShape``) makes
    every ``/generate`` ask for the experts each token was routed to; a generate hook keeps them on its sample
    with :meth:`keep_routed_experts`."""

    def __init__(self, router_url: str, tokenizer: Any = None, timeout: float = 600, max_retries: int = 5,
                 api_key: str | None = None):
        self.url = router_url.rstrip("/")
        # the run's key (multi-node runs): sent as a bearer token to the router and to every engine
        self.api_key = api_key
        self.policy_version = 0  # the weight version the engines serve; the manager sets it after each update
        self.tokenizer = tokenizer
        self.timeout, self.max_retries = timeout, max_retries
        self.retries = 0  # requests sent again after a connection error or a 5xx, since the client was made
        self.routed_experts = None
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
                                **self.asks, **extra}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        shared = _SHARED_REQUESTS.get()
        if shared is not None and input_ids is not None and rid is None and routing_key is None and not extra:
            return await shared.generate(self, body)
        headers = {"X-SMG-Routing-Key": routing_key} if routing_key else None
        return await self._request("POST", self.url + "/generate", body, headers=headers)

    async def max_model_len(self) -> int | None:
        """The engines' context length as SGLang states it (``GET /v1/models``: ``data[0].max_model_len``), asked
        of the URL itself (an engine), else of the first worker the router lists (the router answers
        ``/v1/models`` itself, without it); None when no engine states one."""
        async def stated(url: str) -> int | None:
            try:
                data = await self._request("GET", url + "/v1/models", retries=1)
            except EngineUnreachable:
                raise
            except EngineError:
                return None  # a 4xx: no such endpoint there
            cards = data.get("data") if isinstance(data, dict) else None
            length = cards[0].get("max_model_len") if cards and isinstance(cards[0], dict) else None
            return length if isinstance(length, int) and length > 0 else None

        length = await stated(self.url)
        if length is None:
            try:
                workers = await self.worker_urls()
            except EngineUnreachable:
                raise
            except EngineError:
                workers = []  # not a router
            length = await stated(workers[0].rstrip("/")) if workers else None
        return length

    @property
    def asks(self) -> dict:
        """Top-level fields every ``/generate`` of this client carries."""
        return {"return_routed_experts": True} if self.routed_experts is not None else {}

    def keep_routed_experts(self, sample, meta_info: dict) -> None:
        """With ``routed_experts`` set: ``sample.rollout_routed_experts`` from the answer's ``meta_info`` (SGLang's
        base64 int32 rows, compacted: ``slimecore.routing_replay.decode``) for ``sample.tokens``, which must
        already hold the answer's output; a ``RoutingError`` names what is missing. Without it, nothing."""
        if self.routed_experts is not None:
            from slimecore.routing_replay import decode  # numpy: only where routing is kept

            sample.rollout_routed_experts = decode(meta_info, len(sample.tokens), self.routed_experts,
                                                   sample.rollout_routed_experts)

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

    async def flush_cache(self, timeout: float = 60, poll: float = 0.5, urls: list[str] | None = None) -> None:
        """Flush every engine's cache (``urls``: these engines). An engine answers 400 while requests run; keep
        asking until it is idle, as slime does, up to ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for url in urls if urls is not None else await self.worker_urls():
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

    async def on_every_engine(self, path: str, body: Any = None, urls: list[str] | None = None) -> dict[str, Any]:
        """``POST path`` to every engine at once (the router does not forward control calls; ``urls``: these
        engines, not the router's list); URL -> answer."""
        urls = urls if urls is not None else await self.worker_urls()
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
        urls = await self.worker_urls()
        await self.on_every_engine("/pause_generation", {}, urls)
        await self.flush_cache(urls=urls)

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
