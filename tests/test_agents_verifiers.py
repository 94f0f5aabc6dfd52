"""A verifiers tool episode on the tiny model taught to call ``add`` as verifiers' MCP server advertises it
(tests/agent_toolmodel.py, ``VERIFIERS_TOOLS``): verifiers' null
harness offers the example taskset's MCP tool, the model's call comes back through the session as a tool call,
verifiers runs the tool and sends its result, and the session records both turns as one exact-token sample."""

import asyncio
import json
import re

import pytest

from agent_toolmodel import ANSWER, VERIFIERS_TOOLS

from slimecore.testing.sessions import agent_sessions
from slimecore.testing.engines import embedded_engine
from slimecore.types import Sample

pytest.importorskip("slime_verifiers", reason="the verifiers plugin is installed by scripts/setup.sh")


def test_a_tool_call_episode(tool_checkpoint):
    from slimecore.config import parse_config
    from slimecore.plugins import load_plugins

    from slime_verifiers import plugin

    hooks = load_plugins(["verifiers"])
    config = parse_config(["--hf-checkpoint", str(tool_checkpoint), "--rollout-max-response-len", "96",
                           "--vf-env-args", '{"num_tasks": 4, "task": {"add_tool": true}}'], ["verifiers"],
                          hooks.slime_options(), hooks.slime_implied_options())
    hooks.slime_validate_config(config=config)
    env = plugin.environment(config)
    with embedded_engine(tool_checkpoint) as engine, agent_sessions(engine.url, tool_checkpoint) as sessions:
        sample = Sample(index=0, group_index=0, metadata={"verifiers": {"task": 0, "key": env.tasks[0].key}})
        # greedy, whatever the harness asks: the taught model at temperature 1 may miswrite the call
        session = sessions.open(sample, pinned=("temperature",), max_new_tokens=96, temperature=0)
        reward = asyncio.run(plugin.slime_agent(config=config, sample=sample, session=session))
        samples = sessions.finish(session)
    turns = session.state.trajectory.turns
    meta = sample.metadata["verifiers"]
    assert json.loads(turns[0].tools_key) == VERIFIERS_TOOLS  # the MCP tool, as verifiers' harness offered it
    assert [t.parent for t in turns] == [None, 0] and "<tool_call>" in turns[0].text  # call, then the answer
    assert turns[1].text == ANSWER and meta["stop"] == "agent_completed"
    numbers = re.findall(r"\d+", ANSWER)
    assert reward == meta["rewards"]["correct"] == float(numbers[0] == env.tasks[0].data.answer)
    [episode] = samples  # both turns in one sample: the second prompt extends the first's exact tokens
    first, second = turns
    assert episode.tokens == second.prompt_ids + second.output_ids
    assert second.prompt_ids[:len(first.end_ids)] == first.end_ids
    tool_part = episode.loss_mask[len(first.end_ids) - len(episode.tokens) + len(episode.loss_mask):
                                  len(second.prompt_ids) - len(episode.tokens) + len(episode.loss_mask)]
    assert sum(episode.loss_mask) == len(first.output_ids) + len(second.output_ids) and not any(tool_part)
    assert "3" in sessions.tokenizer.decode(second.prompt_ids[len(first.end_ids):])  # verifiers ran add(1, 2)
