"""Real OpenEnv episodes through an agent session on the tiny engine: the environment's server runs as a uvicorn
process on 127.0.0.1, OpenEnv's own client resets and steps it, the policy's replies are the engine's exact tokens.
An environment that raises or a server that dies fails the sample with a message naming the plugin's cause."""

import asyncio
import sys
from pathlib import Path

import pytest

from slimecore.config import parse_config
from slimecore.plugins import HookCallError, load_plugins
from slimecore.types import Sample

from slime_openenv import plugin
from slime_openenv.guess.server import MAX_GUESSES, first_integer, secret_for

sys.path.insert(0, str(Path(__file__).parent))  # openenv_broken_env, importable here and by the server process


def _config(*argv):
    hooks = load_plugins(["openenv"])
    config = parse_config(["--rollout-max-response-len", "6", *argv], ["openenv"], hooks.slime_options(),
                          hooks.slime_implied_options())
    hooks.slime_validate_config(config=config)
    return hooks, config


def _play(agent_sessions, config, hooks=None, seed=5):
    sample = Sample(index=0, group_index=0, metadata={plugin.METADATA_KEY: {"seed": seed}})
    session = agent_sessions.open(sample, max_new_tokens=6)
    agent = hooks.slime_agent if hooks is not None else plugin.slime_agent
    try:
        reward = asyncio.run(agent(config=config, sample=sample, session=session))
    finally:
        samples = agent_sessions.finish(session)
    return sample, session, reward, samples


def test_an_episode_is_played_by_the_server_and_scored_by_its_rewards(agent_sessions, tiny_hf_checkpoint,
                                                                      monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    _, config = _config("--hf-checkpoint", str(tiny_hf_checkpoint))
    env = plugin.environment(config)
    try:
        sample, session, reward, samples = _play(agent_sessions, config)
    finally:
        plugin.slime_shutdown(config=config, process="rollout")
    assert env.server is None  # stopped by slime_shutdown
    meta = sample.metadata[plugin.METADATA_KEY]
    turns = session.state.trajectory.turns
    # the game replayed from the recorded replies: a guess per reply, higher/lower until right or out of guesses
    guesses = [first_integer(turn.text) for turn in turns]
    hits = [g == secret_for(5) for g in guesses]
    assert len(turns) == meta["steps"] == (hits.index(True) + 1 if any(hits) else MAX_GUESSES)
    assert meta["done"] and reward == meta["reward"] == float(any(hits)) == sum(meta["rewards"])
    assert sample.prompt.startswith("I picked a whole number from 1 to 16")
    assert len(samples) == 1 and samples[0].tokens == turns[-1].prompt_ids + turns[-1].output_ids
    mask = samples[0].loss_mask
    assert sum(mask) == sum(len(t.output_ids) for t in turns)  # model tokens only; the feedback is masked out
    feedback = agent_sessions.tokenizer.decode(turns[-1].prompt_ids)
    assert "guesses left" in feedback or "not a number" in feedback


@pytest.mark.parametrize("app, cause, restarted", [
    ("openenv_broken_env:crashing_app", "the board is on fire", False),
    ("openenv_broken_env:exiting_app", "exited with code 3", True),
])
def test_a_failing_environment_fails_the_sample_naming_the_plugin(agent_sessions, tiny_hf_checkpoint, app, cause,
                                                                  restarted, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    hooks, config = _config("--hf-checkpoint", str(tiny_hf_checkpoint), "--openenv-app", app)
    env = plugin.environment(config)
    pids = []
    try:
        for _ in range(2):  # a server that died is started again for the next episode
            with pytest.raises(HookCallError) as raised:
                _play(agent_sessions, config, hooks)
            pids.append(env.server.process.pid)
            message = str(raised.value)
            assert message.startswith("plugin 'openenv' raised in slime_agent: OpenEnvEpisodeError")
            assert app in message and cause in message
    finally:
        plugin.slime_shutdown(config=config, process="rollout")
    assert (pids[0] != pids[1]) == restarted
