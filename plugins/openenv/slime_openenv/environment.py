"""An OpenEnv environment as the plugin reaches it: its server (started here as a uvicorn process on 127.0.0.1 from
the app's import path, or one already running at a URL), the fields its action and observation schemas use for
text, and one episode played through an agent session.

OpenEnv's own client (``GenericEnvClient``: one WebSocket session per episode, ``reset`` / ``step``) talks to the
server; the policy talks to the episode's agent session through the OpenAI API, so every model call is recorded
with its exact tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("slime_openenv")

RESERVED_OBSERVATION_FIELDS = ("done", "reward", "metadata")


class OpenEnvSetupError(ValueError):
    """The environment cannot be used as configured; the message says which flag and what to do."""


class OpenEnvEpisodeError(RuntimeError):
    """The environment or its server failed during an episode."""


class OpenEnvServerError(RuntimeError):
    """The environment's server did not start, or stopped while episodes ran."""


@dataclass(frozen=True)
class EnvironmentSpec:
    app: str | None            # "module:attribute" of the server's ASGI app (what uvicorn and the env's image run)
    url: str | None            # or a server already running
    action_field: str | None   # the action field the model's reply goes into (None: the only string field)
    observation_field: str | None  # the observation field shown to the model (None: the only string field, or JSON)
    reset_args: dict = field(default_factory=dict)


def load_app(path: str):
    """Import ``module:attribute`` and check it is an OpenEnv server app (one with the ``/ws`` session route)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise OpenEnvSetupError(f"--openenv-app {path!r} must be MODULE:ATTRIBUTE, as uvicorn takes it "
                                f"(e.g. my_env.server.app:app)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own import errors are the user's to see
        raise OpenEnvSetupError(f"--openenv-app {path!r}: cannot import {module_name!r}: "
                                f"{type(exc).__name__}: {exc}") from None
    app = getattr(module, attribute, None)
    if app is None:
        raise OpenEnvSetupError(f"--openenv-app {path!r}: module {module_name!r} has no attribute {attribute!r}")
    if "/ws" not in {getattr(route, "path", None) for route in getattr(app, "routes", ())}:
        raise OpenEnvSetupError(f"--openenv-app {path!r} is not an OpenEnv server app (no /ws route): build it "
                                f"with openenv.core.env_server.create_app(EnvClass, ActionClass, ObservationClass)")
    return app


def fetch_schema(spec: EnvironmentSpec) -> dict:
    """The server's ``/schema`` (action, observation and state JSON schemas), read without starting a process for
    an app, or from the running server at ``--openenv-url``."""
    if spec.url is not None:
        try:
            response = httpx.get(spec.url.rstrip("/") + "/schema", timeout=10.0)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise OpenEnvSetupError(f"--openenv-url {spec.url}: cannot read /schema ({type(exc).__name__}: {exc}); "
                                    f"is the OpenEnv server running there?") from None
        return response.json()
    from starlette.testclient import TestClient

    return TestClient(load_app(spec.app)).get("/schema").json()


def _string_fields(schema: dict, skip=()) -> list[str]:
    return [name for name, prop in schema.get("properties", {}).items()
            if name not in skip and prop.get("type") == "string"]


def text_fields(spec: EnvironmentSpec, schema: dict) -> tuple[str, str | None]:
    """The action field the reply fills and the observation field shown to the model (None: all its fields as
    JSON), from the flags or, when unset, the schemas' only string field."""
    action, observation = schema["action"], schema["observation"]
    action_strings = _string_fields(action, skip=("metadata",))
    if spec.action_field is not None:
        if spec.action_field not in action_strings:
            raise OpenEnvSetupError(f"--openenv-action-field {spec.action_field!r} is not a string field of "
                                    f"{action.get('title', 'the action')} (its string fields: {action_strings})")
        action_field = spec.action_field
    else:
        other_required = set(action.get("required", ())) - set(action_strings)
        if len(action_strings) != 1 or other_required:
            raise OpenEnvSetupError(f"{action.get('title', 'the action')} has string fields {action_strings} and "
                                    f"required fields {sorted(action.get('required', ()))}: name the one the "
                                    f"model's reply fills with --openenv-action-field (a text action is needed)")
        action_field = action_strings[0]
    missing = set(action.get("required", ())) - {action_field}
    if missing:
        raise OpenEnvSetupError(f"{action.get('title', 'the action')} also requires {sorted(missing)}; the plugin "
                                f"fills only --openenv-action-field {action_field!r}")
    if spec.observation_field is not None:
        if spec.observation_field not in observation.get("properties", {}):
            raise OpenEnvSetupError(f"--openenv-observation-field {spec.observation_field!r} is not a field of "
                                    f"{observation.get('title', 'the observation')} "
                                    f"(its fields: {sorted(observation.get('properties', {}))})")
        return action_field, spec.observation_field
    strings = _string_fields(observation, skip=RESERVED_OBSERVATION_FIELDS)
    return action_field, strings[0] if len(strings) == 1 else None


def render_observation(observation: dict, observation_field: str | None) -> str:
    if observation_field is not None:
        value = observation.get(observation_field)
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps({k: v for k, v in observation.items() if k not in RESERVED_OBSERVATION_FIELDS})


class ServerProcess:
    """``APP`` served by uvicorn on a free port of 127.0.0.1 (``slime_openenv.serve``), in its own process group;
    its output goes to a log file whose tail every error quotes."""

    def __init__(self, app: str, start_timeout: float = 120.0):
        self.app, self.start_timeout = app, start_timeout
        self.process: subprocess.Popen | None = None
        self.url = ""
        self._exit_report: str | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="slime-openenv-", suffix=".log", delete=False)

    def start(self) -> "ServerProcess":
        from slimecore.engines.router import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "slime_openenv.serve", self.app, "127.0.0.1", str(port)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise OpenEnvServerError(f"OpenEnv server {self.app} did not answer /health at {self.url} within "
                                 f"{self.start_timeout:g}s; its log:\n{self.log_tail()}")

    def check_alive(self) -> None:
        code = self.process.poll() if self.process is not None else None
        if code is None:
            return
        if self._exit_report is None:  # kept: the log file goes when the server is replaced
            self._exit_report = f"OpenEnv server {self.app} ({self.url}) exited with code {code}; its log:\n" \
                                f"{self.log_tail()}"
        raise OpenEnvServerError(self._exit_report)

    def log_tail(self, lines: int = 20) -> str:
        with open(self._log.name, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        elif self.process is not None:
            with contextlib.suppress(OpenEnvServerError):
                self.check_alive()  # it died by itself: its report outlives the log
        if not self._log.closed:
            self._log.close()
            os.unlink(self._log.name)


class OpenEnvEnvironment:
    """The environment behind ``spec``: its schema-checked text fields now, its server on first ``url()``."""

    def __init__(self, spec: EnvironmentSpec, start_timeout: float = 120.0):
        self.spec, self.start_timeout = spec, start_timeout
        self.action_field, self.observation_field = text_fields(spec, fetch_schema(spec))
        self.server: ServerProcess | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.spec.url or self.spec.app

    def url(self) -> str:
        return self._server().url if self.spec.url is None else self.spec.url

    def _server(self) -> ServerProcess:
        """The server process, started on first use and started again when it died (the episodes it was running
        have failed with its exit code; later ones get a fresh server)."""
        with self._lock:
            if self.server is not None and self.server.process.poll() is not None:
                log.warning("OpenEnv server %s exited with code %s; starting it again", self.spec.app,
                            self.server.process.returncode)
                self.server.stop()
                self.server = None
            if self.server is None:
                self.server = ServerProcess(self.spec.app, self.start_timeout).start()
            return self.server

    def stop(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.stop()
                self.server = None

    @staticmethod
    def explain(exc: BaseException, server: ServerProcess | None) -> str:
        """``exc``'s message, or the exit code and log of ``server`` (the episode's) when it died."""
        if server is not None:
            try:  # a dropped connection is often the process dying: give it a moment to be reaped
                server.process.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
            try:
                server.check_alive()
            except OpenEnvServerError as dead:
                return str(dead)
        return f"{type(exc).__name__}: {exc}"

    async def play(self, session, seed: int, sampling: dict, max_turns: int, system_prompt: str | None) -> "Episode":
        """Reset with ``seed``, then ask the policy and step with its reply until the environment is done or
        ``max_turns`` replies were made."""
        from openenv.core.generic_client import GenericEnvClient

        server = None if self.spec.url is not None else await asyncio.to_thread(self._server)
        model = session.openai_client()
        try:
            return await self._episode(GenericEnvClient(base_url=server.url if server else self.spec.url,
                                                        message_timeout_s=self.start_timeout),
                                       model, session, seed, sampling, max_turns, system_prompt)
        except Exception as exc:
            raise OpenEnvEpisodeError(f"OpenEnv episode (seed {seed}) on {self.name} failed: "
                                      f"{self.explain(exc, server)}") from exc

    async def _episode(self, client, model, session, seed, sampling, max_turns, system_prompt) -> "Episode":
        async with client as env:
            result = await env.reset(seed=seed, **self.spec.reset_args)
            opening = render_observation(result.observation, self.observation_field)
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": opening}]
            episode = Episode(opening=opening, done=result.done)
            while not episode.done and len(episode.rewards) < max_turns:
                reply = await model.chat.completions.create(model=session.model, messages=messages, **sampling)
                text = reply.choices[0].message.content or ""
                result = await env.step({self.action_field: text})
                episode.rewards.append(float(result.reward or 0.0))
                episode.done = result.done
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": render_observation(result.observation, self.observation_field)}]
            episode.last_observation = messages[-1]["content"]
        return episode


@dataclass
class Episode:
    opening: str
    done: bool
    rewards: list[float] = field(default_factory=list)
    last_observation: str = ""

    def reward(self, how: str) -> float:
        if how == "last":
            return self.rewards[-1] if self.rewards else 0.0
        return float(sum(self.rewards))
