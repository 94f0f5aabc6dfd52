"""A tiny model taught to use a tool through the session layer, so tool calls in the tests come from the engine's
own output (parsed by the ``qwen`` parser), not from a stand-in: asked a question with the ``add`` tool offered,
it answers ``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``; given the tool's result it
answers ``The answer is 3``. The teaching episodes are built with the session layer's own ``Trajectory`` (the
second turn's prompt is the first turn's exact tokens plus the rendered tool result), as an agent's requests are.
``TOOL_SCHEMA`` is the tool as both SDKs send it (tests/agents/blackbox_agent.py offers the same)."""

from __future__ import annotations

from pathlib import Path

import pytest

TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": TOOL_SCHEMA}}]
# The same tool as verifiers' MCP server advertises it (plugins/verifiers' example AddToolset), so a verifiers
# harness gets the taught call too.
VERIFIERS_TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "properties": {"a": {"title": "A", "type": "number"}, "b": {"title": "B", "type": "number"}},
    "required": ["a", "b"], "title": "addArguments", "type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "a+b", "input_schema": TOOL_SCHEMA}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ANSWER = "The answer is 3"


def question(a: int) -> str:
    return f"Which number is larger: {a} or {99 - a}? Answer with only the number."


def teaching_rows(tokenizer) -> list[tuple[list[int], list[bool]]]:
    """(token ids, trained) of both turns of a few episodes with each way the tool is offered, as the session layer
    renders them."""
    from slimecore.agents.chat import ChatTemplate
    from slimecore.agents.protocol import parse_openai
    from slimecore.agents.trajectory import Trajectory

    trajectory = Trajectory(ChatTemplate(tokenizer))
    eos = [tokenizer.eos_token_id]
    rows = []
    for offered, a in [(offered, a) for offered in (OPENAI_TOOLS, VERIFIERS_TOOLS) for a in (3, 28, 55, 76)]:
        tools = parse_openai({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": offered}).tools
        first = [{"role": "user", "content": question(a)}]
        call_ids = list(tokenizer(CALL, add_special_tokens=False)["input_ids"]) + eos
        prompt = trajectory.prompt(first, tools)
        answer = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
        trajectory.record(prompt, call_ids, [0.0] * len(call_ids), "stop", answer)
        rows.append((prompt.ids + call_ids, [False] * len(prompt.ids) + [True] * len(call_ids)))
        second = trajectory.prompt(first + [answer, {"role": "tool", "tool_call_id": "c", "content": "3"}], tools)
        answer_ids = list(tokenizer(ANSWER, add_special_tokens=False)["input_ids"]) + eos
        rows.append((second.ids + answer_ids, [False] * len(second.ids) + [True] * len(answer_ids)))
    return rows


def teach(base: Path, out: Path, steps: int = 100, lr: float = 1e-2) -> Path:
    """16 rows (two ways to offer the tool x 4 episodes x 2 turns): 100 steps reproduce every row and make the call
    on 8 of 10 unseen questions with either tool list (checked 2026-11-25), as 200 steps do."""
    import json

    from transformers import AutoTokenizer

    from slimecore.testing.tiny import teach_tiny

    taught = teach_tiny(base, out, teaching_rows(AutoTokenizer.from_pretrained(base)), steps=steps, lr=lr)
    # a 1024-token context (rotary positions: no weight depends on it): a tool episode's second turn is ~480 prompt
    # tokens, and a harness that asks max_tokens 96 on every turn would pass the tiny model's 512, which the agent
    # endpoints refuse as SGLang does
    config_path = Path(taught) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 1024
    config_path.write_text(json.dumps(config, indent=2))
    return taught


@pytest.fixture(scope="session")
def tool_checkpoint(tiny_hf_checkpoint, tmp_path_factory) -> Path:
    from fixtures_engine import built_once

    return built_once(tmp_path_factory, "tool-model", lambda out: teach(tiny_hf_checkpoint, out))
