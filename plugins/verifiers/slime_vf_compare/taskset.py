"""The taskset, written against verifiers' own API (``verifiers.v1``) as any Verifiers environment is: one
``TaskData`` row per line of ``compare.jsonl``, one ``@vf.reward`` that checks the last reply, one ``@vf.metric``,
and with ``{"task": {"add_tool": true}}`` an ``add`` tool the harness offers the model."""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

from slime_vf_compare.tools import AddToolset

DATA = Path(__file__).with_name("compare.jsonl")


class CompareData(vf.TaskData):
    answer: str


class CompareTaskConfig(vf.TaskConfig):
    add_tool: bool = False  # offer the `add` tool (an MCP server per rollout): a multi-turn tool episode


class CompareTask(vf.Task[CompareData, vf.State, CompareTaskConfig]):
    @classmethod
    def toolsets(cls, config: CompareTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig())] if config.add_tool else []

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply's first number is the larger one."""
        numbers = re.findall(r"\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[0] == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class CompareConfig(vf.TasksetConfig):
    num_tasks: int | None = None  # the first N rows; None: all 64
    task: CompareTaskConfig = CompareTaskConfig()


class CompareTaskset(vf.Taskset[CompareTask, CompareConfig]):
    def load(self) -> list[CompareTask]:
        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        return [CompareTask(CompareData(idx=i, prompt=row["question"], answer=row["answer"]), self.config.task)
                for i, row in enumerate(rows[: self.config.num_tasks])]
