"""The session server: OpenAI ``/v1/chat/completions`` and Anthropic ``/v1/messages`` in front of the engines.

One ``SessionServer`` per rollout process serves every agent session on 127.0.0.1, on its own thread and
event loop (so it answers whatever loop the rollout runs on, the fully-async worker's included). Each
request:

1. names its session: header ``X-Session-Id``, else a ``session_id`` field in the body (``extra_body``),
   else the API key (``Authorization: Bearer KEY`` / ``x-api-key: KEY``), or an alias the session added
   (``AgentSession.alias``); an unknown or closed session is
   401 in the API's error shape;
2. is read and checked (``slimecore.agents.protocol``): a malformed message or tool schema is 400;
3. is rendered to prompt ids with exact tokens for everything the model wrote before
   (``slimecore.agents.trajectory``) and sent to ``/generate`` through the rollout client (the router) as
   ``input_ids`` with ``return_logprob``, ``n`` times for ``n`` choices; the session id goes as the router's
   routing key (``X-SMG-Routing-Key``), so under the router's ``manual`` policy one session stays on one
   engine;
4. is recorded (prompt ids, output ids, log-probs, finish reason), its tool calls parsed from the text, and
   answered as JSON or, with ``stream``, as the API's server-sent events (sent once the turn is generated:
   the engine call itself is not streamed token by token).

Sampling: a session has defaults (the run's sampling params) and pinned keys. In a training run
temperature, top-p and top-k are pinned, because the trainer's log-probs assume the run's values; a
client's other value for them is ignored and counted (``SessionState.ignored_sampling``). ``max_tokens``
is capped by the run's ``--rollout-max-response-len``; stop strings add to the run's.

Context: checked as SGLang's tokenizer manager checks it, against the context length the engine states
(``GET /v1/models``: ``max_model_len``). A prompt that fills the context, or a client's ``max_tokens`` that
does not fit beside the prompt, is 400 with SGLang's message (``code: context_length_exceeded``); a request
without ``max_tokens`` generates up to the context and then stops with ``finish_reason`` ``length``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import web

from slimecore import aio
from slimecore.agents import protocol
from slimecore.agents.chat import ChatTemplate, ToolParser, parse_qwen_tool_calls
from slimecore.agents.protocol import APIError, Choice, TurnRequest
from slimecore.agents.trajectory import Trajectory
from slimecore.rollout.client import EngineError

SESSION_HEADER = "X-Session-Id"
PINNED_IN_TRAINING = frozenset({"temperature", "top_p", "top_k"})


@dataclass
class SessionState:
    """One open session: its trajectory, sampling defaults, and what went wrong."""

    id: str
    trajectory: Trajectory
    sampling: dict
    pinned: frozenset
    closed: bool = False
    aborted: bool = False
    ignored_sampling: int = 0
    errors: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # other ids a client may name this session by

    def params(self, req: TurnRequest) -> dict:
        """Engine sampling params for one request: the session's, with what the client may change."""
        params = {k: v for k, v in self.sampling.items() if k not in ("no_stop_trim", "skip_special_tokens")}
        params.update(no_stop_trim=False, skip_special_tokens=True, spaces_between_special_tokens=False)
        asked = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        for key, value in asked.items():
            if value is None:
                continue
            if key in self.pinned:
                self.ignored_sampling += value != params.get(key)
            else:
                params[key] = value
        cap = params.get("max_new_tokens")
        if req.max_tokens is not None:
            params["max_new_tokens"] = req.max_tokens if cap is None else min(cap, req.max_tokens)
        stops = params.get("stop") or []
        params["stop"] = list(dict.fromkeys([*([stops] if isinstance(stops, str) else stops), *req.stop]))
        return params


class SessionServer:
    """Serves agent sessions over HTTP for one engine client (``slimecore.rollout.client.RolloutClient``).

    ``open(...)`` starts a session and returns its state; ``close(id)`` ends it and returns the state (no
    request is recorded after that). ``url`` is the server root: OpenAI clients use ``url + "/v1"``,
    Anthropic clients ``url``."""

    def __init__(self, client, tokenizer, model: str = "slime-policy", tool_parser: ToolParser = parse_qwen_tool_calls,
                 chat_template_kwargs: dict | None = None, host: str = "127.0.0.1", port: int = 0):
        self.client, self.tokenizer, self.model, self.tool_parser = client, tokenizer, model, tool_parser
        self.template = ChatTemplate(tokenizer, chat_template_kwargs)
        self.host, self.port = host, port
        self._sessions: dict[str, SessionState] = {}
        self._lock = threading.Lock()
        self._handle: ThreadedApp | None = None
        self._context: int | None = None
        self._context_asked = False

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30) -> SessionServer:
        self._handle = serve_in_thread(self.app(), self.host, self.port, "slimecore-agent-sessions",
                                       on_stop=self.client.close, timeout=timeout)  # that loop's engine connections
        self.port = self._handle.port
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()

    # -- sessions ----------------------------------------------------------------------------
    def open(self, sampling: dict | None = None, pinned: Iterable[str] = (), session_id: str | None = None
             ) -> SessionState:
        """A new session with these engine sampling defaults; ``pinned`` keys keep their values whatever a
        client asks. The id (also the API key) is random unless given."""
        sid = session_id or "slime-" + uuid.uuid4().hex
        state = SessionState(sid, Trajectory(self.template), dict(sampling or {}), frozenset(pinned))
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid!r} is already open")
            self._sessions[sid] = state
        return state

    def alias(self, session_id: str, key: str) -> None:
        """Record requests that name ``key`` (as session header, ``session_id`` field or API key) in session
        ``session_id`` too, until it closes: for a client that sends its own per-conversation id (verifiers'
        interception sends its trace id as ``X-Session-ID``)."""
        with self._lock:
            state = self._sessions[session_id]
            if self._sessions.setdefault(key, state) is not state:
                raise ValueError(f"{key!r} already names another open session")
            state.aliases.append(key)

    def close(self, session_id: str) -> SessionState:
        with self._lock:
            state = self._sessions.pop(session_id)
            for key in state.aliases:
                self._sessions.pop(key, None)
            state.closed = True
        return state

    def _session(self, request: web.Request, body: dict) -> SessionState:
        auth = request.headers.get("Authorization", "")
        sid = (request.headers.get(SESSION_HEADER) or (body.get("session_id") if isinstance(body, dict) else None)
               or request.headers.get("x-api-key") or (auth[7:] if auth.startswith("Bearer ") else None))
        if not sid:
            raise APIError("authentication", "no session: send the session's API key (Authorization: Bearer KEY or "
                           f"x-api-key), an {SESSION_HEADER} header or a session_id field")
        with self._lock:
            state = self._sessions.get(str(sid))
        if state is None:
            raise APIError("authentication", f"unknown or closed session {str(sid)[:64]!r}: it was never opened by "
                           "this run or its episode has ended")
        if state.aborted:
            raise APIError("aborted", f"session {sid} was aborted by the rollout (its group is no longer needed)")
        return state

    # -- one turn ----------------------------------------------------------------------------
    async def turn(self, state: SessionState, req: TurnRequest, api: str) -> list[Choice]:
        """Generate ``req.n`` answers for one request of a session and record them."""
        prompt = state.trajectory.prompt(req.messages, req.tools)
        params = state.params(req)
        try:
            if not self._context_asked:
                self._context, self._context_asked = await self.client.max_model_len(), True
            fit_context(len(prompt.ids), req.max_tokens, params, self._context)
            outs = await asyncio.gather(*(self.client.generate(input_ids=prompt.ids, sampling_params=params,
                                                               return_logprob=True, routing_key=state.id)
                                          for _ in range(req.n)))
        except EngineError as exc:
            state.errors.append(str(exc))
            kind = "invalid_request" if "HTTP 4" in str(exc) else "engine"
            raise APIError(kind, f"the engine refused this turn: {exc}",
                           code="context_length_exceeded" if "context length" in str(exc) else None) from None
        choices = []
        for out in outs:
            meta = out["meta_info"]
            finish = meta["finish_reason"]["type"]
            if finish == "abort":
                state.aborted = True
                raise APIError("aborted", f"session {state.id} was aborted by the rollout (its group is no longer "
                                          "needed)")
            entries = meta["output_token_logprobs"]
            ids, log_probs = [e[1] for e in entries], [e[0] for e in entries]
            text = out.get("text", "")
            content, calls = self.tool_parser(text) if req.tools and req.use_tools else (text, [])
            calls = [{"id": protocol.new_call_id(api), **call} for call in calls]
            answer = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            with state.trajectory.lock:
                if state.closed:
                    raise APIError("authentication", f"session {state.id} ended while this request ran")
            state.trajectory.record(prompt, ids, log_probs, finish, answer, meta.get("weight_version"), text)
            matched = meta["finish_reason"].get("matched")
            choices.append(Choice(content, calls, finish, matched if isinstance(matched, str) else None,
                                  len(prompt.ids), len(ids)))
        return choices

    # -- HTTP ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The endpoints as an aiohttp application (``start()`` serves it on its own thread; any aiohttp runner
        may serve it instead)."""
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._endpoint("openai"))
        app.router.add_post("/v1/messages", self._endpoint("anthropic"))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
        return app

    async def _models(self, _request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "slime-core"}]})

    def _endpoint(self, api: str) -> Callable:
        parse = protocol.parse_openai if api == "openai" else protocol.parse_anthropic
        error = protocol.openai_error if api == "openai" else protocol.anthropic_error

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                try:
                    body = await request.json()
                except ValueError:
                    raise APIError("invalid_request", "the request body is not valid JSON") from None
                state = self._session(request, body)
                req = parse(body)
                choices = await self.turn(state, req, api)
            except APIError as exc:
                return web.json_response(error(exc), status=exc.status)
            model = req.model or self.model
            if not req.stream:
                data = (protocol.openai_response(choices, model) if api == "openai"
                        else protocol.anthropic_response(choices[0], model))
                return web.json_response(data)
            events = (protocol.openai_stream(choices, model, req.include_usage) if api == "openai"
                      else protocol.anthropic_stream(choices[0], model))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            for event in events:
                await response.write(event)
            await response.write_eof()
            return response

        return handle


def fit_context(prompt_len: int, max_tokens: int | None, params: dict, context: int | None) -> None:
    """SGLang's context checks for one turn, with its messages (its tokenizer manager's
    ``_validate_one_request``): a prompt of ``context`` tokens or more, or a client's ``max_tokens`` that does not
    fit beside the prompt, raises a 400. Without ``max_tokens`` the engine's ``max_new_tokens`` (the session's
    cap) is lowered to what fits, so the turn generates up to the context and ends with ``length``, as SGLang's
    scheduler clamps it. ``context`` None: the engine's own checks apply."""
    if not context:
        return
    if prompt_len >= context:
        raise APIError("invalid_request", f"The input ({prompt_len} tokens) is longer than the model's context "
                                          f"length ({context} tokens).", code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > context:
        raise APIError("invalid_request", (
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {prompt_len + max_tokens} tokens: {prompt_len} tokens from the input messages and "
            f"{max_tokens} tokens for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."), code="context_length_exceeded")
    cap = params.get("max_new_tokens")
    if max_tokens is None and cap is not None and prompt_len + cap > context:
        params["max_new_tokens"] = context - prompt_len


@dataclass
class ThreadedApp:
    """An aiohttp application served on its own thread and event loop; ``stop()`` ends both."""

    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)


def serve_in_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0, name: str = "aiohttp-app", *,
                    on_stop: Callable | None = None, runner_kwargs: dict | None = None,
                    timeout: float = 30) -> ThreadedApp:
    """Serve ``app`` on ``host:port`` (0: a free port) from a new thread with its own event loop, so it answers
    whatever loop the caller runs; ``on_stop`` (a coroutine function) runs on that loop before it closes."""
    started, failure, box = threading.Event(), [], {}

    def serve():
        loop = aio.new_event_loop()
        box["loop"] = loop
        runner = web.AppRunner(app, **{"access_log": None, **(runner_kwargs or {})})
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            box["port"] = site._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # reported by the caller
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        if on_stop is not None:
            loop.run_until_complete(on_stop())
        loop.close()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    if not started.wait(timeout) or failure:
        raise RuntimeError(f"{name} did not start on {host}:{port}: {failure[0] if failure else 'timed out'}")
    return ThreadedApp(box["port"], box["loop"], thread)


def served_model_name(checkpoint: str | None) -> str:
    """The model name the session server reports: the checkpoint directory's name."""
    from pathlib import Path

    return Path(checkpoint).name if checkpoint else "slime-policy"


