"""Agent sessions for tests: a ``SessionServer`` in front of a real engine, so an environment author runs an
agent (any OpenAI or Anthropic client, or a subprocess) against a real tiny model and inspects the samples.

    with agent_sessions(engine.url, checkpoint) as sessions:
        session = sessions.open(max_new_tokens=16)       # an AgentSession: base_url, api_key, model, run()
        reward = await my_plugin.slime_agent(config=..., sample=session.sample, session=session)
        samples = sessions.finish(session)               # the training samples, as the rollout would get them

The ``agent_sessions`` fixture (``slimecore.testing.pytest_plugin``) is this on the ``tiny_engine``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


class Sessions:
    """Opens sessions on one server and turns them into samples."""

    def __init__(self, server, tokenizer):
        self.server, self.tokenizer = server, tokenizer

    @property
    def url(self) -> str:
        return self.server.url

    def open(self, sample=None, pinned=(), **sampling):
        """A new ``AgentSession`` for ``sample`` (default: an empty one) with these engine sampling params."""
        from slimecore.agents.session import AgentSession
        from slimecore.types import Sample

        state = self.server.open({"max_new_tokens": 32, **sampling}, pinned=pinned)
        return AgentSession(state, self.server, sample or Sample(index=0, group_index=0))

    def finish(self, session) -> list:
        """Close ``session`` and return its samples (one per branch of its history, one ``rollout_id``)."""
        self.server.close(session.id)
        return session.state.trajectory.to_samples(session.sample, self.tokenizer)


@contextlib.contextmanager
def agent_sessions(engine_url: str, checkpoint: str | Path, tool_parser: str = "qwen") -> Iterator[Sessions]:
    """A started session server for the engine (or router) at ``engine_url``, using ``checkpoint``'s tokenizer."""
    from slimecore.agents.chat import tool_parser as parser
    from slimecore.agents.server import SessionServer, served_model_name
    from slimecore.hf_checkpoint import load_tokenizer
    from slimecore.rollout.client import RolloutClient

    tokenizer = load_tokenizer(str(checkpoint))
    server = SessionServer(RolloutClient(engine_url, tokenizer=tokenizer), tokenizer,
                           model=served_model_name(str(checkpoint)), tool_parser=parser(tool_parser)).start()
    try:
        yield Sessions(server, tokenizer)
    finally:
        server.stop()
