"""A taskset with a taskset-scoped (shared) tool server, which the plugin refuses (tests/test_verifiers_plugin.py)."""

import verifiers.v1 as vf

from slime_vf_compare.tools import AddToolset


class SharedToolsTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddToolset(vf.ToolsetConfig())]

    def load(self):
        return [vf.Task(vf.TaskData(idx=0, prompt="1+2?"))]


__all__ = ["SharedToolsTaskset"]
