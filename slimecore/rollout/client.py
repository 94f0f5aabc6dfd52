"""The one rollout client: what generate hooks use to talk to the engines (through the router).

It speaks SGLang's native API, so it serves the embedded CPU engine and SGLang alike. Plugins never
build URLs themselves: ``await client.generate(input_ids=..., sampling_params=...)``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp


class EngineError(RuntimeError):
    """An engine or the router answered with an error, or could not be reached after retries."""


class RolloutClient:
    def __init__(self, router_url: str, tokenizer: Any = None, timeout: float = 600, max_retries: int = 5):
        self.url = router_url.rstrip("/")
        self.tokenizer = tokenizer
        self.timeout, self.max_retries = timeout, max_retries
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(id(loop))
        if session is None or session.closed:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                            connector=aiohttp.TCPConnector(limit=0))
            self._sessions[id(loop)] = session
        return session

    async def _request(self, method: str, url: str, json: Any = None, retries: int | None = None) -> Any:
        retries = self.max_retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            try:
                async with self._session().request(method, url, json=json) as response:
                    text = await response.text()
                    if response.status < 300:
                        return await response.json(content_type=None) if text else None
                    if response.status < 500:
                        raise EngineError(f"{method} {url} -> HTTP {response.status}: {text[:500]}")
                    last = f"HTTP {response.status}: {text[:300]}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < retries:
                await asyncio.sleep(min(10.0, 0.2 * 2**attempt) * (1 + random.random() * 0.1))
        raise EngineError(f"{method} {url} failed after {retries + 1} attempts; last error: {last}")

    async def generate(self, input_ids: list[int] | None = None, sampling_params: dict | None = None, *,
                       text: str | None = None, return_logprob: bool = True, rid: str | None = None) -> dict:
        """POST /generate through the router; returns SGLang's response (``text``, ``output_ids``,
        ``meta_info`` with ``finish_reason`` and, when asked, ``output_token_logprobs``)."""
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        if rid:
            body["rid"] = rid
        return await self._request("POST", self.url + "/generate", body)

    async def worker_urls(self) -> list[str]:
        data = await self._request("GET", self.url + "/workers")
        workers = data.get("workers", data) if isinstance(data, dict) else data
        return [w["url"] if isinstance(w, dict) else w for w in workers]

    async def abort_all(self, timeout: float = 60) -> None:
        """Abort every request on every engine (the router does not forward aborts) and wait until idle."""
        urls = await self.worker_urls()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            await asyncio.gather(*(self._request("POST", u + "/abort_request", {"abort_all": True}) for u in urls))
            loads = await asyncio.gather(*(self._request("GET", u + "/v1/loads?include=core") for u in urls))
            busy = sum(l["num_running_reqs"] + l["num_waiting_reqs"] for data in loads for l in data["loads"])
            if busy == 0:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"engines {urls} still had {busy} requests {timeout:.0f}s after abort")
            await asyncio.sleep(0.05)

    async def flush_cache(self) -> None:
        for url in await self.worker_urls():
            await self._request("POST", url + "/flush_cache", retries=0)

    async def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        urls = await self.worker_urls()
        results = await asyncio.gather(*(self._request("POST", u + "/update_weights_from_disk",
                                                       {"model_path": path, "weight_version": weight_version},
                                                       retries=0) for u in urls))
        failed = [(u, r) for u, r in zip(urls, results) if not r.get("success")]
        if failed:
            raise EngineError(f"update_weights_from_disk failed on {failed}")

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
