"""``AgentSession``: what an agent hook (``slime_agent``) gets to reach the policy being trained.

    @hookimpl
    async def slime_agent(config, sample, session):
        client = session.openai_client()           # or session.anthropic_client()
        reply = await client.chat.completions.create(model=session.model, messages=[...], tools=[...])
        ...
        return reward                              # or None: the reward hooks score the samples

    @hookimpl
    async def slime_agent(config, sample, session):  # any program: the SDKs read these variables
        result = await session.run([sys.executable, "my_agent.py"], input=json.dumps(sample.prompt))
        return float(result.stdout.strip().splitlines()[-1])

Fields: ``base_url`` (OpenAI style, ends in ``/v1``), ``anthropic_base_url`` (the root: the Anthropic SDK adds
``/v1/messages``), ``api_key`` (the session id: every request with it is recorded in this session),
``model`` (the name the server reports), ``sample`` (the prompt being played). ``env()`` holds
``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, ``OPENAI_MODEL``,
``ANTHROPIC_MODEL`` and ``SLIME_SESSION_ID``. ``turns`` counts the model calls recorded so far. ``alias(key)``
lets a client name the session by an id of its own (verifiers sends its trace id as ``X-Session-ID``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from typing import Any

from slimecore.agents.server import SessionServer, SessionState
from slimecore.types import AgentProcess, Sample  # AgentProcess: importable from here


class AgentProcessError(RuntimeError):
    """A subprocess agent exited with an error; the message has its exit code and the tail of its stderr."""


class AgentSession:
    def __init__(self, state: SessionState, server: SessionServer, sample: Sample):
        self.state, self.sample, self.model, self._server = state, sample, server.model, server
        self.id = self.api_key = state.id
        self.anthropic_base_url = server.url
        self.base_url = server.url + "/v1"

    @property
    def turns(self) -> int:
        return len(self.state.trajectory.turns)

    def alias(self, key: str) -> None:
        """Also record the requests that name ``key`` as their session (header, ``session_id`` field or API key)
        in this session: for a client that sends an id of its own, such as a framework's trace id."""
        self._server.alias(self.id, key)

    def env(self) -> dict[str, str]:
        """Environment variables that point the OpenAI and Anthropic SDKs (and CLIs built on them) at this session."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
                "ANTHROPIC_BASE_URL": self.anthropic_base_url, "ANTHROPIC_API_KEY": self.api_key,
                "ANTHROPIC_MODEL": self.model, "SLIME_SESSION_ID": self.id}

    def openai_client(self, **options: Any):
        """An ``openai.AsyncOpenAI`` for this session (needs the ``openai`` package)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **options})

    def anthropic_client(self, **options: Any):
        """An ``anthropic.AsyncAnthropic`` for this session (needs the ``anthropic`` package)."""
        import anthropic

        return anthropic.AsyncAnthropic(base_url=self.anthropic_base_url, api_key=self.api_key,
                                        **{"max_retries": 0, **options})

    async def run(self, args: Sequence[str], *, input: str | bytes | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, check: bool = True) -> AgentProcess:
        """Run a program with ``env()`` added to this process's environment (and ``env`` over both), feed it
        ``input`` on stdin, wait for it and return its output. It runs in its own process group, which is killed
        when the hook is cancelled (its ``--agent-timeout`` ran out, or the rollout stopped). With ``check``, a
        non-zero exit raises ``AgentProcessError``."""
        args = [str(a) for a in args]
        process = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=cwd, env={**os.environ, **self.env(), **(env or {})}, start_new_session=True)
        data = input.encode() if isinstance(input, str) else input
        try:
            stdout, stderr = await process.communicate(data)
        except asyncio.CancelledError:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
            raise
        result = AgentProcess(args, process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))
        if check and result.returncode != 0:
            tail = "\n".join(result.stderr.splitlines()[-15:])
            raise AgentProcessError(f"agent {args[0]} exited with code {result.returncode}; stderr tail:\n{tail}")
        return result
