"""The model's side of a chat turn: render canonical messages with its chat template, and read tool calls
out of its text.

Rendering: ``ChatTemplate.render`` passes ``tools`` to the tokenizer's template when the template reads them
(Qwen2.5, Qwen3, Llama 3.1 ...). A template that knows no tools (ChatML-only ones such as SmolLM2's) gets
them the Hermes / Qwen way instead: the tool signatures in the system message inside ``<tools></tools>``,
an assistant's tool calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` lines in its
text, and tool results as a user message of ``<tool_response>`` blocks. Either way the model writes calls
the ``qwen`` parser reads.

Tool-call parsers map the text of one model turn to ``(content, calls)`` where ``calls`` are canonical
``{"type": "function", "function": {"name", "arguments": dict}}``. Built in: ``qwen`` (alias ``hermes``;
``<tool_call>`` JSON objects, the format of Qwen2.5/Qwen3, Hermes and the fallback above) and ``none``.
``--agent-tool-parser module:function`` names any other callable with that signature.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable

ToolParser = Callable[[str], "tuple[str, list[dict]]"]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINEL = "\x00slimecore-assistant\x00"


def parse_qwen_tool_calls(text: str) -> tuple[str, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (arguments may be a JSON string).
    The content is the text before the first block, stripped. A block that is not such an object leaves the
    whole text as content and no calls (the client sees what the model wrote)."""
    blocks = _CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            data = json.loads(block)
            arguments = data["arguments"] if "arguments" in data else data.get("parameters", {})
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
        if not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
            return text, []
        calls.append({"type": "function", "function": {"name": data["name"], "arguments": arguments}})
    return text[:text.find("<tool_call>")].strip(), calls


def parse_no_tool_calls(text: str) -> tuple[str, list[dict]]:
    return text, []


TOOL_PARSERS: dict[str, ToolParser] = {"qwen": parse_qwen_tool_calls, "hermes": parse_qwen_tool_calls,
                                       "none": parse_no_tool_calls}


def tool_parser(name: str) -> ToolParser:
    """A built-in parser by name, or ``module:function``; ValueError naming the choices otherwise."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--agent-tool-parser {name}: cannot load it ({exc})") from None
        if not callable(found):
            raise ValueError(f"--agent-tool-parser {name}: {attr} is not callable")
        return found
    raise ValueError(f"--agent-tool-parser {name!r} is unknown; use one of {sorted(TOOL_PARSERS)} or "
                     "module:function (text -> (content, tool calls))")


def _hermes_system(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"# Tools\n<tools>\n{lines}\n</tools>\nTo call a tool, write <tool_call>\n{{\"name\": ..., "
            "\"arguments\": {...}}\n</tool_call>")


def _hermes_calls(calls: list[dict]) -> str:
    return "".join("\n<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                   ensure_ascii=False) + "\n</tool_call>" for c in calls)


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Canonical messages as plain ``{"role", "content"}`` ones for a template that knows no tools."""
    out: list[dict] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + _hermes_system(tools)})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": _hermes_system(tools)})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": m["content"] + _hermes_calls(m["tool_calls"])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


_PROBE_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                              "b": {"type": "integer"}}, "required": ["a", "b"]}}}
_PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3? Ünïcode, \"quotes\""},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"},
               {"role": "assistant", "content": "It is 5.\n"}, {"role": "user", "content": "  and 1 + 1?"}]
_PROBES = [(chat, tools, generation) for chat in (_PROBE_CHAT[1:2], _PROBE_CHAT[:2], _PROBE_CHAT, _PROBE_CHAT[:5])
           for tools in (None, [_PROBE_TOOL]) for generation in (True, False)]


class ChatTemplate:
    """Renders canonical messages to text and token ids with one tokenizer's chat template.

    ``closing_ids``: the tokens the template writes after an assistant message's text (ChatML:
    ``<|im_end|>`` ``\\n``); a model turn that ended on a prefix of them (its EOS) gets the rest as glue."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; agent sessions render every request with it")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.reads_tools = "tools" in tokenizer.chat_template
        self._compiled, self._backend = None, None
        self._compiled, self._backend = self._fast_paths()
        text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], None,
                           add_generation_prompt=False)
        self.closing_ids = self.encode(text[text.index(_SENTINEL) + len(_SENTINEL):])

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        if not self.reads_tools:
            messages, tools = hermes_messages(messages, tools), None
        if self._compiled is not None:
            return self._compiled[tools is not None].render(messages=messages, tools=tools, documents=None,
                                                            add_generation_prompt=add_generation_prompt,
                                                            **self._variables)
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fast_paths(self):
        """The session layer renders and tokenises on every turn, and ``apply_chat_template`` / ``tokenizer(...)``
        spend most of their time copying and wrapping (each message rebuilt, a ``BatchEncoding`` per call). The
        messages here are canonical plain JSON already, so the compiled template (the one ``apply_chat_template``
        uses, with the same variables) and the fast tokenizer's backend give the same text and ids for a fraction
        of the cost. Each is used only if it agrees with the slow path on probe conversations (tools, tool calls,
        several turns, both ``add_generation_prompt`` values); otherwise, or with another transformers, the slow
        path stays."""
        self._compiled, slow = None, []
        for messages, tools, generation in _PROBES:
            try:  # a probe this template refuses (say, a system message) checks nothing
                slow.append(((messages, tools, generation), self.render(messages, tools, generation)))
            except Exception:
                continue
        compiled = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            tools_probe = [_PROBE_TOOL] if self.reads_tools else None
            compiled = (_compile_jinja_template(self.tokenizer.get_chat_template(None, None)),
                        _compile_jinja_template(self.tokenizer.get_chat_template(None, tools_probe)))
            self._variables = {**self.tokenizer.special_tokens_map, **self.kwargs}
            self._compiled = compiled
            if not slow or any(self.render(*probe) != text for probe, text in slow):
                compiled = None
        except Exception:  # a transformers without these internals, or a template that needs its preprocessing
            compiled = None
        backend = getattr(self.tokenizer, "_tokenizer", None)
        try:
            texts = [text for _, text in slow]
            if [backend.encode(text, add_special_tokens=False).ids for text in texts] != \
                    [list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]:
                backend = None
        except Exception:  # not a fast (tokenizers-backed) tokenizer
            backend = None
        return compiled, backend

    def glue(self, output_ids: list[int]) -> list[int]:
        """What closes a model turn that produced ``output_ids``: the closing tokens it did not write itself."""
        closing = self.closing_ids
        for overlap in range(min(len(closing), len(output_ids)), 0, -1):
            if output_ids[-overlap:] == closing[:overlap]:
                return closing[overlap:]
        return list(closing)
