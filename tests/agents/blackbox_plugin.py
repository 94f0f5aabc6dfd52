"""The slime_agent plugin that trains tests/agents/blackbox_agent.py: each episode runs the program as a subprocess
in its session (the OpenAI SDK for even sample indices, the Anthropic SDK for odd ones) and rewards an episode
whose answer after a tool call states the tool's result."""

import json
import sys
from pathlib import Path

from slimecore import hookimpl

AGENT = Path(__file__).with_name("blackbox_agent.py")


@hookimpl
async def slime_agent(config, sample, session):
    api = "anthropic" if sample.index % 2 else "openai"
    result = await session.run([sys.executable, str(AGENT)], input=json.dumps({"prompt": sample.prompt, "api": api}))
    episode = json.loads(result.stdout.strip().splitlines()[-1])
    sample.metadata["blackbox"] = {**episode, "api": api}
    return 1.0 if any(str(value) in episode["after_tool"] for value in episode["tool_results"]) else 0.0
