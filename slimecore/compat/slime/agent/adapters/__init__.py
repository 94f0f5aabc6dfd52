"""slime-core shim of ``slime.agent.adapters``: ``AnthropicAdapter`` / ``OpenAIAdapter`` as slime's agent functions
use them (``open_session`` / ``app`` / ``finish_session`` / ``drop_session``), each one a slime-core
``SessionServer`` (``slimecore.agents.server``) in front of the run's router.

What is the same: the session id is the client's API key (``Authorization: Bearer SID`` / ``x-api-key``) or a
``session_id`` body field (slime also reads ``metadata.session_id`` and ``user``; slime-core does not); every turn is rendered with the chat template and sent as
``input_ids`` with ``return_logprob`` and the session id as ``X-SMG-Routing-Key``; ``finish_session`` returns the
token-exact samples (one per branch of a rewritten history, one ``rollout_id``) with ``reward`` and
``extra_metadata`` set. What differs: both adapters serve both APIs (``/v1/messages`` and
``/v1/chat/completions``; OpenAI's ``/v1/responses`` is not served); ``tool_parser`` takes sglang's Qwen/Hermes
names (``qwen25``, ``qwen``, ``hermes``) or slime-core's own (``--agent-tool-parser``); ``reasoning_parser``,
``max_turns_per_sid``, ``fork_threshold_tokens`` and ``debug_callback`` are refused when set (no counterpart
here); ``max_context_tokens`` is not a cut (the engine's context bounds a turn).
"""

from __future__ import annotations

from slimecore.agents.chat import tool_parser as named_tool_parser
from slimecore.agents.server import PINNED_IN_TRAINING, SessionServer
from slimecore.types import Sample

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
SGLANG_TOOL_PARSERS = {"qwen25": "qwen", "qwen": "qwen", "hermes": "hermes"}  # sglang name -> slime-core's


class BaseAdapter:
    """A session server for ``tokenizer`` in front of the SGLang server or router at ``sglang_url``."""

    def __init__(self, *, tokenizer, sglang_url: str, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, max_turns_per_sid: int | None = None,
                 fork_threshold_tokens: int | None = None, debug_callback=None) -> None:
        from slimecore.rollout.client import RolloutClient

        unsupported = {"reasoning_parser": reasoning_parser, "max_turns_per_sid": max_turns_per_sid,
                       "fork_threshold_tokens": fork_threshold_tokens, "debug_callback": debug_callback}
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise ValueError(f"{type(self).__name__}({', '.join(given)}=...): slime-core's agent sessions have no "
                             "counterpart; leave them unset (see slimecore/compat/slime/agent/adapters)")
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        parser = named_tool_parser(SGLANG_TOOL_PARSERS.get(tool_parser, tool_parser) if tool_parser else "qwen")
        self.server = SessionServer(RolloutClient(self.sglang_url, tokenizer=tokenizer), tokenizer,
                                    tool_parser=parser)
        self.app = self.server.app()

    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        """Open session ``sid`` with these SGLang sampling params (temperature, top-p and top-k pinned: the
        trainer's log-probs assume them); ValueError when it is already open."""
        self.server.open(sampling_defaults, pinned=PINNED_IN_TRAINING, session_id=sid)

    async def finish_session(self, sid: str, *, base_sample: Sample | None = None, reward: float = 0.0,
                             extra_metadata: dict | None = None, wait_timeout: float = 5.0) -> list[Sample]:
        """Close ``sid`` and return its samples (``[]`` for a session already finished or dropped)."""
        state = self._close(sid)
        if state is None:
            return []
        samples = state.trajectory.to_samples(base_sample or Sample(), self.tokenizer)
        for sample in samples:
            sample.reward, sample.session_id = reward, sid
            sample.metadata.update(extra_metadata or {})
        return samples

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Close ``sid`` without samples (idempotent)."""
        self._close(sid)

    shutdown_session = drop_session

    def _close(self, sid: str):
        try:
            return self.server.close(sid)
        except KeyError:  # finished or dropped before
            return None


class AnthropicAdapter(BaseAdapter):
    """slime's Anthropic Messages adapter (Claude Code style agents)."""


class OpenAIAdapter(BaseAdapter):
    """slime's OpenAI Chat Completions adapter (OpenAI SDK / Agents SDK style clients)."""
