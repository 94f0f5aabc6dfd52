"""The taskset, written against verifiers' own API (``verifiers.v1``) as any Verifiers environment is: one
``TaskData`` row per line of ``compare.jsonl``, one ``@vf.reward`` that checks the last reply."""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).with_name("compare.jsonl")


class CompareData(vf.TaskData):
    answer: str


class CompareTask(vf.Task[CompareData]):
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


class CompareTaskset(vf.Taskset[CompareTask, CompareConfig]):
    def load(self) -> list[CompareTask]:
        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        return [CompareTask(CompareData(idx=i, prompt=row["question"], answer=row["answer"]), self.config.task)
                for i, row in enumerate(rows[: self.config.num_tasks])]
