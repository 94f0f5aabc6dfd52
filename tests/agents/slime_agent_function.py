"""An agent function written for THUDM/slime as its docs show (docs/en/get_started/agent.md and
examples/coding_agent_rl/generate.py at 624b824), imported only from ``slime``: a custom generate function that
starts an ``OpenAIAdapter`` once, opens a session per sample, lets an agent (here the official ``openai`` SDK, with
one ``add`` tool) talk to the adapter's app, and returns ``adapter.finish_session``'s samples with the reward.

    --custom-generate-function-path slime_agent_function.generate
"""

import json
import secrets

import openai

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
_SERVICE = {}


def _adapter(args):
    if not _SERVICE:
        tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        adapter = OpenAIAdapter(
            tokenizer=tokenizer,
            sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
            tool_parser=getattr(args, "sglang_tool_call_parser", None) or None,
            reasoning_parser=getattr(args, "sglang_reasoning_parser", None) or None,
        )
        handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0, thread_name="openai-adapter")
        _SERVICE.update(adapter=adapter, url=f"http://127.0.0.1:{handle.port}")
    return _SERVICE["adapter"], _SERVICE["url"]


async def generate(args, base_sample: Sample, sampling_params: dict, evaluation: bool = False):
    adapter, url = _adapter(args)
    session_id = base_sample.session_id = f"slime-agent-{secrets.token_hex(8)}"
    adapter.open_session(session_id, sampling_defaults=sampling_params)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=session_id, max_retries=0)
    messages = [{"role": "user", "content": base_sample.prompt}]
    results, answer = [], ""
    for _ in range(2):  # one tool round
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            results.append(arguments.get("a", 0) + arguments.get("b", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(results[-1])})
    reward = 1.0 if results and str(results[-1]) in answer else 0.0
    return await adapter.finish_session(session_id, base_sample=base_sample, reward=reward,
                                        extra_metadata={"tool_results": results, "answer": answer})
