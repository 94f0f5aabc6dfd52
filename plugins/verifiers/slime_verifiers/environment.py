"""One Verifiers environment, as the plugin uses it: its tasks, and one episode of a task through an agent session.

The environment is what ``vf-eval`` would load for the same ids (``verifiers.v1.resolve_env_config``): the
taskset package ``--vf-env`` with ``--vf-env-args`` as its ``TasksetConfig`` fields, and the agent seat with the
harness ``--vf-harness``. An episode is verifiers' own rollout (``vf.Agent.run``): the harness program runs in a
``LocalInterpreterRuntime`` box, talks to verifiers' interception server, which forwards every model call to the
session's ``/v1/chat/completions`` (so the session records the exact tokens) with the rollout's trace id as
``X-Session-ID``; the session takes that id as an alias. The task's rewards and metrics score the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.agent import resolve_agent
from verifiers.v1.configs.env import default_agent_harness

from slime_verifiers.runtime import LocalInterpreterRuntime

API_KEY_VARIABLE = "SLIME_VERIFIERS_API_KEY"  # unset: the session is named by the trace id, not by a key


class VerifiersSetupError(ValueError):
    """The environment cannot be loaded or used as asked; the message names the flag to change."""


@dataclass(frozen=True)
class EnvironmentSpec:
    env_id: str
    env_args: dict
    harness: str
    num_tasks: int | None = None
    max_turns: int | None = None


class VerifiersEnvironment:
    def __init__(self, spec: EnvironmentSpec):
        self.spec = spec
        flags = f"--vf-env {spec.env_id} / --vf-env-args / --vf-harness {spec.harness}"
        try:
            env_class = vf.environment_class(spec.env_id)
        except ValueError as exc:  # a package exporting several Envs
            raise VerifiersSetupError(f"{flags}: {exc}") from None
        if env_class is not vf.SingleAgentEnv:
            raise VerifiersSetupError(
                f"--vf-env {spec.env_id} runs its episodes with {env_class.__name__}, a multi-agent Env; this "
                "plugin plays single-agent environments (one harness per episode, every plain taskset)")
        try:
            config = vf.resolve_env_config({"taskset": {"id": spec.env_id, **spec.env_args},
                                            "agent": {"harness": {"id": spec.harness}, "max_turns": spec.max_turns,
                                                      "runtime": {"type": "subprocess"}}})
            taskset = vf.load_taskset(config.taskset)
        except (ImportError, ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise VerifiersSetupError(f"{flags}: {exc}") from None
        if type(taskset).toolsets(taskset.config):
            raise VerifiersSetupError(
                f"--vf-env {spec.env_id} declares taskset-scoped (shared) tool servers (Taskset.toolsets); this "
                "plugin starts tools per rollout only: declare them on the task (Task.toolsets)")
        if not taskset.bounded and spec.num_tasks is None:
            raise VerifiersSetupError(f"--vf-env {spec.env_id} is an infinite taskset: give --vf-num-tasks")
        self.tasks: list[vf.Task] = list(taskset.take(spec.num_tasks) if spec.num_tasks else taskset)
        if not self.tasks:
            raise VerifiersSetupError(f"--vf-env {spec.env_id} with --vf-env-args {spec.env_args} has no tasks")
        self.agent_config = config.agent
        self.default_harness = default_agent_harness(spec.env_id)
        self._agent: vf.Agent | None = None
        self._agent_key: tuple | None = None

    def agent(self, session, sampling: dict[str, Any]) -> vf.Agent:
        """The agent seat for this session's server (rebuilt when the server or the sampling changes, e.g. a
        session server started again in the same process)."""
        key = (session.base_url, session.model, tuple(sorted(sampling.items())))
        if self._agent is None or self._agent_key != key:
            client = vf.EvalClientConfig(base_url=session.base_url, api_key_var=API_KEY_VARIABLE)
            config = resolve_agent(self.agent_config, model=session.model, client=client,
                                   sampling=vf.SamplingConfig(**sampling), harness=self.default_harness)
            self._agent, self._agent_key = vf.Agent(config), key
        return self._agent

    async def play(self, task: vf.Task, session, sampling: dict[str, Any]) -> vf.Trace:
        """One rollout of ``task`` whose model calls are recorded in ``session``; the scored trace."""
        runtime = LocalInterpreterRuntime(name=f"slime-{session.id}")
        runtime.env = dict(task.runtime_env())
        await runtime.start()
        try:
            return await self.agent(session, sampling).run(task, runtime=runtime,
                                                           on_trace=lambda trace: session.alias(trace.id))
        finally:
            await runtime.stop()
