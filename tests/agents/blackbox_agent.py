"""A black-box agent: a program that knows nothing of slime-core. It reads a task as JSON on stdin
({"prompt": ..., "api": "openai" | "anthropic"}), talks to a model through the official SDK named by "api"
(configured only by OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL or the ANTHROPIC_* variables), offers it
one tool (add), runs the tool calls it makes, and prints {"answer": ..., "turns": ..., "tool_calls": ...}."""

import json
import os
import sys

MAX_TURNS = 3


def add(a=0, b=0):
    return a + b


def run_openai(prompt):
    import openai

    client = openai.OpenAI(max_retries=0)
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    messages = [{"role": "user", "content": prompt}]
    calls = 0
    for turn in range(1, MAX_TURNS + 1):
        reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools,
                                               max_tokens=8)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or "", turn, calls
        for call in message.tool_calls:
            calls += 1
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return "", MAX_TURNS, calls


def run_anthropic(prompt):
    import anthropic

    client = anthropic.Anthropic(max_retries=0)
    tools = [{"name": "add", "description": "a+b", "input_schema": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]
    messages = [{"role": "user", "content": prompt}]
    calls = 0
    for turn in range(1, MAX_TURNS + 1):
        reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=8, messages=messages,
                                       tools=tools)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text"), turn, calls
        calls += len(uses)
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": str(add(**u.input))} for u in uses]})
    return "", MAX_TURNS, calls


def main():
    task = json.load(sys.stdin)
    prompt = task["prompt"] if isinstance(task["prompt"], str) else task["prompt"][-1]["content"]
    answer, turns, calls = (run_openai if task["api"] == "openai" else run_anthropic)(prompt)
    print(json.dumps({"answer": answer, "turns": turns, "tool_calls": calls}))


if __name__ == "__main__":
    main()
