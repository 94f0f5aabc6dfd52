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
        text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], None,
                           add_generation_prompt=False)
        self.closing_ids = self.encode(text[text.index(_SENTINEL) + len(_SENTINEL):])

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        if self.reads_tools:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **self.kwargs)
        return self.tokenizer.apply_chat_template(hermes_messages(messages, tools), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def glue(self, output_ids: list[int]) -> list[int]:
        """What closes a model turn that produced ``output_ids``: the closing tokens it did not write itself."""
        closing = self.closing_ids
        for overlap in range(min(len(closing), len(output_ids)), 0, -1):
            if output_ids[-overlap:] == closing[:overlap]:
                return closing[overlap:]
        return list(closing)
