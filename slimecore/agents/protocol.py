"""The two chat APIs, as requests in and responses out: OpenAI Chat Completions and Anthropic Messages.

Both are read into one canonical form, the HF chat-template message format the model's template takes::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id": str, "type": "function", "function": {"name": str, "arguments": dict}}],  # assistant
     "tool_call_id": str}                                                                            # tool

plus tools in HF form (``{"type": "function", "function": {"name", "description", "parameters"}}``) and a
:class:`TurnRequest` of sampling settings. A request the API would refuse raises :class:`APIError`, which
each API renders in its own error shape and HTTP status (``openai_error`` / ``anthropic_error``).
Responses are built from a :class:`Choice` (the text shown to the client and the parsed tool calls), as a
JSON body or as the API's server-sent events.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class APIError(Exception):
    """A request the API refuses. ``kind`` is one of ``invalid_request`` (400), ``authentication`` (401),
    ``not_found`` (404), ``aborted`` (400: the rollout stopped this session), ``engine`` (500)."""

    STATUS = {"invalid_request": 400, "authentication": 401, "not_found": 404, "aborted": 400, "engine": 500}

    def __init__(self, kind: str, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code

    def __reduce__(self):  # crosses processes (Ray) with every field
        return type(self), (self.kind, self.message, self.param, self.code)

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


def openai_error(err: APIError) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {"invalid_request": "invalid_request_error", "authentication": "invalid_request_error",
            "not_found": "invalid_request_error", "aborted": "invalid_request_error", "engine": "server_error"}
    code = err.code or {"authentication": "invalid_api_key", "aborted": "session_aborted"}.get(err.kind)
    return {"error": {"message": err.message, "type": kind[err.kind], "param": err.param, "code": code}}


def anthropic_error(err: APIError) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
            "not_found": "not_found_error", "aborted": "invalid_request_error", "engine": "api_error"}
    return {"type": "error", "error": {"type": kind[err.kind], "message": err.message}}


@dataclass
class TurnRequest:
    """One request, API-independent: canonical messages and tools, and what the client asked of sampling
    (None: the session's default)."""

    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    use_tools: bool = True  # tool_choice "none": tool calls in the output stay text
    model: str = ""


@dataclass
class Choice:
    """One generated answer as the client sees it: ``text`` (stop strings cut, tool calls taken out),
    ``tool_calls`` (canonical), the engine's finish type (``stop`` | ``length``), the stop string matched, and
    token counts."""

    text: str
    tool_calls: list[dict]
    finish: str
    matched_stop: str | None
    prompt_tokens: int
    completion_tokens: int


# ---------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------


def _named_model(body: dict) -> bool:
    """Both APIs answer 400 to a request without ``model`` (this server serves one policy, whatever its name)."""
    return isinstance(body.get("model"), str) and bool(body["model"])


def _require(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise APIError("invalid_request", message, param)


def _number(body: dict, key: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    _require(ok and not isinstance(value, bool) and low <= value <= high,
             f"'{key}' must be {'an integer' if integer else 'a number'} in [{low}, {high}], got {value!r}", key)
    return value


def _stop_list(value: Any, key: str, limit: int) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    _require(isinstance(items, list) and all(isinstance(s, str) for s in items) and len(items) <= limit,
             f"'{key}' must be a string or a list of at most {limit} strings", key)
    return [s for s in items if s]


def _schema(value: Any, where: str, param: str) -> dict:
    """A tool's parameter schema: a JSON Schema object (``type: object``) or nothing."""
    if value is None:
        return {"type": "object", "properties": {}}
    _require(isinstance(value, dict), f"{where} must be a JSON Schema object, got {type(value).__name__}", param)
    _require(value.get("type", "object") == "object",
             f"{where} must describe an object (\"type\": \"object\"), got type {value.get('type')!r}", param)
    _require(isinstance(value.get("properties", {}), dict), f"{where}.properties must be an object", param)
    return value


def _tool_name(name: Any, param: str) -> str:
    _require(isinstance(name, str) and bool(TOOL_NAME.match(name)),
             f"{param} must be a string of 1-64 letters, digits, '_' or '-', got {name!r}", param)
    return name


def _text_parts(content: Any, param: str, text_type: str) -> str:
    """A string, or a list of text parts (``{"type": text_type, "text": ...}``), as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _require(isinstance(content, list), f"{param} must be a string or a list of content parts", param)
    texts = []
    for i, part in enumerate(content):
        _require(isinstance(part, dict) and part.get("type") == text_type and isinstance(part.get("text"), str),
                 f"{param}[{i}]: only {text_type!r} parts are supported (this model reads text), got "
                 f"{part.get('type') if isinstance(part, dict) else type(part).__name__!r}", f"{param}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


# ---------------------------------------------------------------------------------------------
# OpenAI Chat Completions
# ---------------------------------------------------------------------------------------------


def parse_openai(body: Any) -> TurnRequest:
    """Read a ``/v1/chat/completions`` body; raise APIError for what OpenAI would answer 400."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    _require(_named_model(body), "you must provide a model parameter", "model")  # OpenAI's words
    messages = body.get("messages")
    _require(isinstance(messages, list) and bool(messages), "'messages' must be a non-empty array", "messages")
    canon = [_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = None
    if body.get("tools") is not None:
        _require(isinstance(body["tools"], list), "'tools' must be an array", "tools")
        tools = [_openai_tool(t, f"tools[{i}]") for i, t in enumerate(body["tools"])] or None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _number({key: max_tokens}, key, 1, 2**31, integer=True)
    n = _number(body, "n", 1, 128, integer=True) or 1
    stream_options = body.get("stream_options") or {}
    _require(isinstance(stream_options, dict), "'stream_options' must be an object", "stream_options")
    choice = body.get("tool_choice")
    return TurnRequest(canon, tools, max_tokens=max_tokens, temperature=_number(body, "temperature", 0, 2),
                       top_p=_number(body, "top_p", 0, 1), stop=_stop_list(body.get("stop"), "stop", 4), n=n,
                       stream=bool(body.get("stream")), include_usage=bool(stream_options.get("include_usage")),
                       use_tools=choice != "none", model=str(body.get("model") or ""))


def _openai_message(m: Any, param: str) -> dict:
    _require(isinstance(m, dict), f"{param} must be an object", param)
    role = m.get("role")
    if role in ("system", "developer"):
        return {"role": "system", "content": _text_parts(m.get("content"), f"{param}.content", "text")}
    if role == "user":
        _require(m.get("content") is not None, f"{param}.content is required for a user message", f"{param}.content")
        return {"role": "user", "content": _text_parts(m["content"], f"{param}.content", "text")}
    if role == "assistant":
        out = {"role": "assistant", "content": _text_parts(m.get("content"), f"{param}.content", "text")}
        calls = m.get("tool_calls") or []
        _require(isinstance(calls, list), f"{param}.tool_calls must be an array", f"{param}.tool_calls")
        if calls:
            out["tool_calls"] = [_openai_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
        return out
    if role == "tool":
        _require(isinstance(m.get("tool_call_id"), str), f"{param}.tool_call_id is required for a tool message",
                 f"{param}.tool_call_id")
        return {"role": "tool", "content": _text_parts(m.get("content"), f"{param}.content", "text"),
                "tool_call_id": m["tool_call_id"]}
    raise APIError("invalid_request", f"{param}.role must be one of 'system', 'developer', 'user', 'assistant', "
                   f"'tool'; got {role!r}", f"{param}.role")


def _openai_call(c: Any, param: str) -> dict:
    _require(isinstance(c, dict) and isinstance(c.get("function"), dict), f"{param} must have a 'function'", param)
    fn = c["function"]
    name = _tool_name(fn.get("name"), f"{param}.function.name")
    arguments = fn.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise APIError("invalid_request", f"{param}.function.arguments is not valid JSON: {fn.get('arguments')!r}",
                       f"{param}.function.arguments") from None
    _require(isinstance(arguments, dict), f"{param}.function.arguments must be a JSON object",
             f"{param}.function.arguments")
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": name, "arguments": arguments}}


def _openai_tool(t: Any, param: str) -> dict:
    _require(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict),
             f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    fn = t["function"]
    out = {"name": _tool_name(fn.get("name"), f"{param}.function.name"),
           "parameters": _schema(fn.get("parameters"), f"{param}.function.parameters", f"{param}.function.parameters")}
    if fn.get("description") is not None:
        out["description"] = str(fn["description"])
    return {"type": "function", "function": out}


def _call_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def openai_tool_calls(choice: Choice) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in choice.tool_calls]


def _openai_finish(choice: Choice) -> str:
    """Complete tool calls win over the length limit (the parser only returns complete ones)."""
    if choice.tool_calls:
        return "tool_calls"
    return "length" if choice.finish == "length" else "stop"


def openai_response(choices: list[Choice], model: str) -> dict:
    messages = []
    for i, choice in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.text if choice.text or not choice.tool_calls
                                   else None}
        if choice.tool_calls:
            message["tool_calls"] = openai_tool_calls(choice)
        messages.append({"index": i, "message": message, "finish_reason": _openai_finish(choice), "logprobs": None})
    return {"id": _call_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": messages, "usage": _usage(choices)}


def _usage(choices: list[Choice]) -> dict:
    prompt = choices[0].prompt_tokens if choices else 0
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def openai_stream(choices: list[Choice], model: str, include_usage: bool) -> list[bytes]:
    """The response as SSE ``chat.completion.chunk`` events, ending with ``data: [DONE]``."""
    base = {"id": _call_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> bytes:
        data = {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **extra}
        return f"data: {json.dumps(data)}\n\n".encode()

    events = []
    for i, choice in enumerate(choices):
        events.append(chunk(i, {"role": "assistant", "content": ""}))
        if choice.text:
            events.append(chunk(i, {"content": choice.text}))
        for j, call in enumerate(openai_tool_calls(choice)):
            events.append(chunk(i, {"tool_calls": [{"index": j, **call}]}))
        events.append(chunk(i, {}, _openai_finish(choice)))
    if include_usage:
        events.append(f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(choices)})}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


# ---------------------------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------------------------


def parse_anthropic(body: Any) -> TurnRequest:
    """Read a ``/v1/messages`` body; raise APIError for what Anthropic would answer 400."""
    _require(isinstance(body, dict), "the request body must be a JSON object")
    _require(_named_model(body), "model: Field required", "model")  # Anthropic's words
    _require(isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool)
             and body["max_tokens"] >= 1, "max_tokens: field required (an integer >= 1)", "max_tokens")
    messages = body.get("messages")
    _require(isinstance(messages, list) and bool(messages), "messages: must be a non-empty array", "messages")
    canon: list[dict] = []
    system = body.get("system")
    if system is not None:
        canon.append({"role": "system", "content": _text_parts(system, "system", "text")})
    for i, m in enumerate(messages):
        canon.extend(_anthropic_message(m, f"messages.{i}"))
    _answered_calls_only(canon)
    tools = None
    if body.get("tools") is not None:
        _require(isinstance(body["tools"], list), "tools: must be an array", "tools")
        tools = [_anthropic_tool(t, f"tools.{i}") for i, t in enumerate(body["tools"])] or None
    choice = body.get("tool_choice") or {}
    _require(isinstance(choice, dict), "tool_choice: must be an object", "tool_choice")
    return TurnRequest(canon, tools, max_tokens=body["max_tokens"], temperature=_number(body, "temperature", 0, 1),
                       top_p=_number(body, "top_p", 0, 1), top_k=_number(body, "top_k", 1, 2**31, integer=True),
                       stop=_stop_list(body.get("stop_sequences"), "stop_sequences", 8192),
                       stream=bool(body.get("stream")), use_tools=choice.get("type") != "none",
                       model=str(body.get("model") or ""))


def _anthropic_message(m: Any, param: str) -> list[dict]:
    """One Anthropic message as canonical messages: a user message's ``tool_result`` blocks become tool
    messages (before its text), an assistant's ``tool_use`` blocks its tool calls; thinking is dropped."""
    _require(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
             f"{param}.role: must be 'user' or 'assistant'", f"{param}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    _require(isinstance(content, list), f"{param}.content: must be a string or an array of blocks", f"{param}.content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _require(isinstance(block.get("text"), str), f"{where}.text: must be a string", where)
            texts.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            _require(isinstance(block.get("input"), dict), f"{where}.input: must be an object", where)
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": _tool_name(block.get("name"), f"{where}.name"),
                                       "arguments": block["input"]}})
        elif kind == "tool_result" and m["role"] == "user":
            _require(isinstance(block.get("tool_use_id"), str), f"{where}.tool_use_id: field required", where)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text_parts(block.get("content"), f"{where}.content", "text")})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            continue
        else:
            raise APIError("invalid_request", f"{where}: block type {kind!r} is not supported in a {m['role']} "
                           "message (text, tool_use in assistant, tool_result in user)", where)
    out = list(results)
    if texts or calls or not results:
        message = {"role": m["role"], "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _answered_calls_only(messages: list[dict]) -> None:
    """Every tool result answers a ``tool_use`` of an earlier assistant message, as Anthropic requires (400)."""
    called: set[str] = set()
    for number, message in enumerate(messages):
        called.update(c["id"] for c in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise APIError("invalid_request", f"unexpected `tool_use_id` found in `tool_result` blocks: "
                           f"{message['tool_call_id']}. Each `tool_result` block must have a corresponding "
                           "`tool_use` block in an earlier assistant message", "messages")


def _anthropic_tool(t: Any, param: str) -> dict:
    _require(isinstance(t, dict), f"{param}: must be an object", param)
    _require("input_schema" in t, f"{param}.input_schema: field required", f"{param}.input_schema")
    out = {"name": _tool_name(t.get("name"), f"{param}.name"),
           "parameters": _schema(t["input_schema"], f"{param}.input_schema", f"{param}.input_schema")}
    if t.get("description") is not None:
        out["description"] = str(t["description"])
    return {"type": "function", "function": out}


def _anthropic_stop(choice: Choice) -> tuple[str, str | None]:
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish == "length":
        return "max_tokens", None
    return ("stop_sequence", choice.matched_stop) if choice.matched_stop else ("end_turn", None)


def anthropic_blocks(choice: Choice) -> list[dict]:
    blocks = [{"type": "text", "text": choice.text}] if choice.text or not choice.tool_calls else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": c["function"]["arguments"]}
               for c in choice.tool_calls]
    return blocks


def anthropic_response(choice: Choice, model: str) -> dict:
    reason, sequence = _anthropic_stop(choice)
    return {"id": _call_id("msg_"), "type": "message", "role": "assistant", "model": model,
            "content": anthropic_blocks(choice), "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": choice.prompt_tokens, "output_tokens": choice.completion_tokens}}


def anthropic_stream(choice: Choice, model: str) -> list[bytes]:
    """The response as Anthropic's SSE events: message_start, one content block each (start, delta, stop),
    message_delta with the stop reason, message_stop."""
    def event(kind: str, data: dict) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    message = anthropic_response(choice, model)
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": choice.prompt_tokens, "output_tokens": 0}}
    events = [event("message_start", {"message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append(event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
            events.append(event("content_block_delta", {"index": i, "delta": {"type": "text_delta",
                                                                                "text": block["text"]}}))
        else:
            events.append(event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}))
            events.append(event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        events.append(event("content_block_stop", {"index": i}))
    events.append(event("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                                    "stop_sequence": message["stop_sequence"]},
                                          "usage": {"output_tokens": choice.completion_tokens}}))
    events.append(event("message_stop", {}))
    return events


def new_call_id(api: str) -> str:
    """A tool-call id in the API's style (``call_...`` for OpenAI, ``toolu_...`` for Anthropic)."""
    return _call_id("call_" if api == "openai" else "toolu_")
