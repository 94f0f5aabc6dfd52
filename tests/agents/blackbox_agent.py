"""A black-box agent: a program that knows nothing of slime-core. It reads a task as JSON on stdin
({"prompt": ..., "api": "openai" | "anthropic"}), talks to a model through the official SDK named by "api"
(configured only by OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL or the ANTHROPIC_* variables), offers it
one tool (add) and runs the calls it makes, then compacts its context: one last request whose history is a
summary instead of the conversation. It prints {"answer", "after_tool", "tool_results", "turns"} as JSON."""

import json
import os
import sys

MAX_TURNS = 2  # one tool round: the tiny model has a 512-token context
SCHEMA = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}


def add(a=0, b=0):
    return a + b


class OpenAIChat:
    def __init__(self):
        import openai

        self.client, self.model = openai.OpenAI(max_retries=0), os.environ["OPENAI_MODEL"]
        self.tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": SCHEMA}}]

    def ask(self, messages, tools=True):
        """One model call: (assistant message to append, text, [(call id, arguments)])."""
        reply = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=96,
                                                    **({"tools": self.tools} if tools else {}))
        message = reply.choices[0].message
        calls = [(c.id, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return message.model_dump(exclude_none=True), message.content or "", calls

    def results(self, done):
        return [{"role": "tool", "tool_call_id": call_id, "content": str(value)} for call_id, value in done]


class AnthropicChat:
    def __init__(self):
        import anthropic

        self.client, self.model = anthropic.Anthropic(max_retries=0), os.environ["ANTHROPIC_MODEL"]
        self.tools = [{"name": "add", "description": "a+b", "input_schema": SCHEMA}]

    def ask(self, messages, tools=True):
        reply = self.client.messages.create(model=self.model, max_tokens=96, messages=messages,
                                            **({"tools": self.tools} if tools else {}))
        text = "".join(b.text for b in reply.content if b.type == "text")
        calls = [(b.id, b.input) for b in reply.content if b.type == "tool_use"]
        return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}, text, calls

    def results(self, done):
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": str(value)}
                                             for call_id, value in done]}]


def main():
    task = json.load(sys.stdin)
    prompt = task["prompt"] if isinstance(task["prompt"], str) else task["prompt"][-1]["content"]
    chat = OpenAIChat() if task["api"] == "openai" else AnthropicChat()
    messages, results, after_tool, turns = [{"role": "user", "content": prompt}], [], "", 0
    for turns in range(1, MAX_TURNS + 1):
        message, text, calls = chat.ask(messages)
        messages.append(message)
        if results:
            after_tool = text
        if not calls:
            break
        done = [(call_id, add(**arguments)) for call_id, arguments in calls]
        results += [value for _, value in done]
        messages += chat.results(done)
    notes = f"add returned {results[-1]}" if results else "no tool used"
    _, answer, _ = chat.ask([{"role": "user", "content": f"{prompt} Notes: {notes}."}], tools=False)
    print(json.dumps({"answer": answer, "after_tool": after_tool, "tool_results": results, "turns": turns + 1}))


if __name__ == "__main__":
    main()
