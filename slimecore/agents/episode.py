"""The built-in generate's agent path: one ``slime_agent`` episode per sample, through a session.

``run_episode`` opens a session on this process's ``SessionServer`` (started on first use, stopped by the
built-in plugin's ``slime_shutdown``), awaits the agent hook under ``--agent-timeout``, closes the session
and turns its turns into samples (``Trajectory.to_samples``: one per branch, one ``rollout_id``). A reward the
hook returns goes to every sample; None leaves them to the reward hooks. An agent that raises, times out or
never calls the model gives one FAILED sample (reward 0, not trained, ``metadata["agent_error"]``); an episode
the rollout aborted gives an ABORTED sample, which goes back to the buffer like any aborted sample.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from slimecore.agents.chat import tool_parser
from slimecore.agents.server import PINNED_IN_TRAINING, SessionServer, served_model_name
from slimecore.agents.session import AgentSession
from slimecore.errors import HookCallError
from slimecore.types import Sample, Status

if TYPE_CHECKING:
    from slimecore.protocols import AgentHook

log = logging.getLogger("slimecore.agents")
DEFAULT_AGENT_TIMEOUT = 600.0
_SERVER: SessionServer | None = None
_SERVER_LOCK = threading.Lock()


def session_server(config, client) -> SessionServer:
    """This process's session server, started on first use with the run's tokenizer and tool parser."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            if client.tokenizer is None:
                raise ValueError("agent sessions need the rollout client's tokenizer (RolloutClient(tokenizer=...))")
            _SERVER = SessionServer(client, client.tokenizer, model=served_model_name(config.hf_checkpoint),
                                    tool_parser=tool_parser(config.agent_tool_parser or "qwen"),
                                    chat_template_kwargs=config.apply_chat_template_kwargs).start()
            log.info("agent sessions served at %s", _SERVER.url)
        return _SERVER


def stop_session_server() -> None:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is not None:
            _SERVER.stop()
            _SERVER = None


async def run_episode(config, sample: Sample, client, agent: AgentHook, sampling_params: dict) -> list[Sample]:
    """Play ``sample`` with ``agent``, the run's ``slime_agent`` hook; see the module docstring."""
    server = session_server(config, client)
    if sample.response_length:
        sample.reset_response()  # an aborted episode starts again: a half-run agent cannot be resumed
    state = server.open(sampling_params, pinned=PINNED_IN_TRAINING)
    session = AgentSession(state, server, sample)
    timeout = config.agent_timeout or DEFAULT_AGENT_TIMEOUT
    failure, reward = None, None

    try:
        reward = await asyncio.wait_for(agent(config=config, sample=sample, session=session), timeout)
    except asyncio.TimeoutError:
        failure = f"the agent did not finish within --agent-timeout {timeout:g}s"
    except HookCallError as exc:
        failure = str(exc)
    finally:
        server.close(state.id)
    sample.session_id = state.id
    if state.aborted:
        sample.status = Status.ABORTED
        return [sample]
    samples = state.trajectory.to_samples(sample, client.tokenizer)
    if failure is None and not samples:
        failure = "the agent finished without a model call in its session"
    for s in samples or [sample]:
        s.metadata.update({"agent_turns": len(state.trajectory.turns), "agent_ignored_sampling": state.ignored_sampling})
        if failure is not None:
            s.status, s.reward, s.remove_sample = Status.FAILED, 0.0, True
            s.metadata["agent_error"] = failure
        elif reward is not None:
            s.reward = reward
    if failure is not None:
        log.warning("agent episode of sample %s failed: %s", sample.index, failure)
    return samples or [sample]
