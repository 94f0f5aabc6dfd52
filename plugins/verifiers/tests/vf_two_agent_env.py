"""A taskset package that exports a multi-agent Env, which the plugin refuses (tests/test_verifiers_plugin.py)."""

import verifiers.v1 as vf


class TwoAgentTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        return [vf.Task(vf.TaskData(idx=0, prompt="1+2?"))]


class TwoAgentEnv(vf.Env):
    async def run(self, task, agents):
        await agents.first.run(task)


__all__ = ["TwoAgentEnv", "TwoAgentTaskset"]
