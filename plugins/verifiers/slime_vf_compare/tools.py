"""The example's tool, a task-scoped MCP server that verifiers starts per rollout (``python -m`` this module)."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # advertised as plain `add`

    @vf.tool
    def add(self, a: float, b: float) -> str:
        """a+b"""
        total = a + b
        return str(int(total) if float(total).is_integer() else total)


if __name__ == "__main__":
    AddToolset.run()
