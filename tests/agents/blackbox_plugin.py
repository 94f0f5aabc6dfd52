"""The slime_agent plugin that trains tests/agents/blackbox_agent.py: each episode runs the program as a
subprocess in its session (alternating the OpenAI and Anthropic SDK by sample index) and rewards an answer
that holds a digit (the tiny random model writes digits about half the time: a signal GRPO can use)."""

import json
import sys
from pathlib import Path

from slimecore import hookimpl

AGENT = Path(__file__).with_name("blackbox_agent.py")


@hookimpl
async def slime_agent(config, sample, session):
    api = "anthropic" if sample.index % 2 else "openai"
    result = await session.run([sys.executable, str(AGENT)], input=json.dumps({"prompt": sample.prompt, "api": api}))
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    sample.metadata["blackbox"] = {**answer, "api": api}
    return 1.0 if any(ch.isdigit() for ch in answer["answer"]) else 0.0
