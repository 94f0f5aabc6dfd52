"""One real verifiers rollout through an agent session on the tiny engine: verifiers' own null harness (its chat
program, run on this interpreter), its interception server, the session endpoint, the taskset's reward."""

import asyncio
import re

from slimecore.config import parse_config
from slimecore.plugins import load_plugins
from slimecore.types import Sample

from slime_verifiers import plugin


def _config(*argv):
    hooks = load_plugins(["verifiers"])
    config = parse_config(["--rollout-max-response-len", "24", *argv], ["verifiers"], hooks.slime_options(),
                          hooks.slime_implied_options())
    hooks.slime_validate_config(config=config)
    return config


def test_one_episode_is_recorded_with_exact_tokens_and_scored_by_the_rubric(agent_sessions, tiny_hf_checkpoint):
    config = _config("--hf-checkpoint", str(tiny_hf_checkpoint), "--vf-env-args", '{"num_tasks": 4}')
    env = plugin.environment(config)
    task = env.tasks[1]
    sample = Sample(index=0, group_index=0, metadata={plugin.METADATA_KEY: {"task": 1, "key": task.key}})
    session = agent_sessions.open(sample, max_new_tokens=24)
    reward = asyncio.run(plugin.slime_agent(config=config, sample=sample, session=session))
    samples = agent_sessions.finish(session)
    meta = sample.metadata[plugin.METADATA_KEY]
    assert meta["stop"] == "agent_completed" and meta["trace_id"] in session.state.aliases
    turns = session.state.trajectory.turns
    assert len(turns) == 1 and len(samples) == 1
    reply = turns[0].text
    numbers = re.findall(r"\d+", reply)
    assert reward == meta["rewards"]["correct"] == float(bool(numbers) and numbers[0] == task.data.answer)
    # the tiny random model may write bytes that are not UTF-8: the reply the environment read and the turn's
    # text then may count a broken byte run as a different number of U+FFFD characters, and nothing else differs
    assert abs(meta["metrics"]["reply_chars"] - len(reply)) <= reply.count("\ufffd")
    assert samples[0].tokens == turns[0].prompt_ids + turns[0].output_ids  # the engine's own ids, nothing re-tokenised
    assert samples[0].rollout_log_probs == turns[0].log_probs and sum(samples[0].loss_mask) == len(turns[0].output_ids)
    assert task.data.prompt in agent_sessions.tokenizer.decode(turns[0].prompt_ids)  # the harness sent the task
