"""``--rm-type remote_rm``: score a sample with an HTTP reward service, as slime's ``remote_rm``.

Each sample is ``POST``ed to ``--rm-url`` as JSON ``{"prompt", "response", "label"}`` (the sample's
prompt, which is a string or a list of chat messages, its response text and its label). The service
answers with a JSON number (the reward) or a JSON object (a dict reward; pick the trained field with
``--reward-key``). Every request may take ``--rm-timeout`` seconds. Connection errors, timeouts, HTTP 5xx
and 429 are retried up to ``--rm-max-retries`` attempts in all, waiting ``min(d * 2**k, 30) + d * U(0,1)``
seconds after failed attempt ``k`` (``d = --rm-retry-delay``; with ``d = 1`` that is slime's backoff);
after the last attempt :class:`RemoteRewardError` names the URL, the attempts and the last error, and
the rollout marks the sample FAILED and counts it (``rollout/reward_failures``). The first failed attempt
to a URL is said at once in one warning line (the URL, the answer's status and first bytes, how many
retries follow and about how long they take: ~2.5 min with the defaults), so the backoff is never silent.

Departures from slime: another 4xx, a body that is not JSON, or JSON that is neither a number nor an
object fails at once (retrying cannot fix it) instead of being retried; the timeout is per request
(slime: 120 s for the session's requests, fixed); one aiohttp session is kept per event loop, because the
fully-async rollout scores on its own loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import aiohttp

BACKOFF_CAP = 30.0
log = logging.getLogger("slimecore.rewards")
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
_warned: set[str] = set()  # URLs whose first failed attempt this process has said


class RemoteRewardError(RuntimeError):
    """The reward service could not score a sample; the message says where, how often and why."""


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    for dead in [other for other in _sessions if other.is_closed()]:
        del _sessions[dead]
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = _sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    return session


async def close_session() -> None:
    """Close the running event loop's session (for a loop that ends before the rollout shuts down)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def close_sessions() -> None:
    """Close the sessions of event loops that are idle (called at rollout shutdown, outside any loop)."""
    for loop, session in list(_sessions.items()):
        del _sessions[loop]
        if not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(session.close())


def _reward(url: str, text: str):
    try:
        reward = json.loads(text)
    except ValueError:
        raise RemoteRewardError(f"remote_rm: POST {url} answered 200 with a body that is not JSON: {text[:200]!r}; "
                                "it must answer a JSON number or object") from None
    if isinstance(reward, bool) or not isinstance(reward, (int, float, dict)):
        raise RemoteRewardError(f"remote_rm: POST {url} answered {text[:200]}; the reward must be a JSON number or "
                                "object (a dict reward, picked with --reward-key)")
    return reward


def _backoff(attempt: int, retry_delay: float) -> float:
    return min(retry_delay * 2 ** attempt, BACKOFF_CAP)


def _warn_first_failure(url: str, status: int | None, what: str, attempts: int, retry_delay: float) -> None:
    """One line, once per URL: the first failed attempt and the retries that follow (before they start)."""
    if url in _warned:
        return
    _warned.add(url)
    wait = sum(_backoff(k, retry_delay) + retry_delay / 2 for k in range(attempts - 1))
    answer = f"HTTP {status}: {' '.join(what[:400].split())[:120]!r}" if status is not None else what
    log.warning("remote_rm: POST %s -> %s; retrying %d more time(s) with backoff (about %.0f s: --rm-max-retries %d, "
                "--rm-retry-delay %g) before the sample fails", url, answer, attempts - 1, wait, attempts, retry_delay)


async def remote_reward(url: str, prompt, response: str, label, *, timeout: float, attempts: int,
                        retry_delay: float):
    """POST one sample to ``url`` and return its reward (a number or a dict); see the module docstring."""
    payload = {"prompt": prompt, "response": response, "label": label}
    last = ""
    for attempt in range(attempts):
        status, text = None, ""
        try:
            async with _session().post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
                status, text = answer.status, await answer.text()
                if answer.status < 300:
                    return _reward(url, text)
                last = f"HTTP {answer.status}: {text[:300]}"
                if answer.status < 500 and answer.status != 429:
                    raise RemoteRewardError(f"remote_rm: POST {url} -> {last} (not retried: the request itself "
                                            "was refused); check --rm-url and what the service expects")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"no answer within --rm-timeout {timeout:g}s" if isinstance(exc, asyncio.TimeoutError) else \
                f"{type(exc).__name__}: {exc}"
        if attempt + 1 < attempts:
            if attempt == 0:
                _warn_first_failure(url, status, text if status is not None else last, attempts, retry_delay)
            await asyncio.sleep(_backoff(attempt, retry_delay) + retry_delay * random.random())
    raise RemoteRewardError(f"remote_rm: POST {url} failed after {attempts} attempt(s) (--rm-max-retries); "
                            f"last error: {last}")
