"""The built-in data source (slime's RolloutDataSourceWithBuffer), with its buffer checkpointed.

Prompts come from ``--prompt-data`` or a built-in task. ``get_samples(n)`` returns ``n`` groups of
``--n-samples-per-prompt`` copies, buffered groups (aborted partial rollouts) first. The state
(position, epoch, indices and the buffer itself) round-trips, so a resumed run draws exactly the
prompts an uninterrupted run would have, and resumes the partial samples slime would lose.
"""

from __future__ import annotations

import copy
import random
from typing import Callable

from slimecore.data.dataset import read_rows, to_prompts
from slimecore.data.tasks import TASKS
from slimecore.types import DataSource, Sample

BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]


def pop_first(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


def load_prompts(config, tokenizer, spec: str | None, *, input_key=None, label_key=None, eval_set: bool = False):
    """Prompt records from a file spec, ``task:NAME``, or (spec None) the configured built-in task."""
    task_name = spec[len("task:"):] if spec and spec.startswith("task:") else None if spec else config.task
    if task_name is not None:
        if task_name not in TASKS:
            raise ValueError(f"unknown built-in task {task_name!r}; known: {', '.join(sorted(TASKS))}")
        n = 64 if eval_set else config.task_size
        seed = config.rollout_seed + (1_000_003 if eval_set else 0)  # eval prompts are held out from training
        rows = list(enumerate(TASKS[task_name].make_rows(n, seed), start=1))
        source, input_key, label_key, chat = f"task:{task_name}", "input", "label", True
    else:
        rows, source = read_rows(spec), spec
        input_key, label_key, chat = input_key or config.input_key, label_key or config.label_key, config.apply_chat_template
    records, filtered = to_prompts(rows, source, tokenizer, input_key=input_key, label_key=label_key,
                                   metadata_key=config.metadata_key, tool_key=config.tool_key, apply_chat_template=chat,
                                   chat_template_kwargs=config.apply_chat_template_kwargs,
                                   max_prompt_len=config.rollout_max_prompt_len)
    if not records:
        raise ValueError(f"{source}: no prompts left after filtering ({filtered} longer than --rollout-max-prompt-len)")
    return records, filtered


class PromptDataSource(DataSource):
    def __init__(self, records: list[dict], n_samples_per_prompt: int, shuffle: bool = False, seed: int = 42,
                 buffer_filter: BufferFilter | None = None, num_filtered: int = 0):
        self.records, self.n = records, n_samples_per_prompt
        self.shuffle, self.seed = shuffle, seed
        self.buffer_filter = buffer_filter or pop_first
        self.num_filtered = num_filtered
        self.buffer: list[list[Sample]] = []
        self.epoch, self.offset, self.next_group, self.next_index = 0, 0, 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.records)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.buffer_filter(self.buffer, num_groups) if self.buffer else []
        while len(groups) < num_groups:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order()
            record = self.records[self._order[self.offset]]
            self.offset += 1
            group = []
            for _ in range(self.n):
                group.append(Sample(group_index=self.next_group, index=self.next_index, prompt=record["prompt"],
                                    tokens=list(record["tokens"]), label=record["label"],
                                    metadata=copy.deepcopy(record["metadata"])))
                self.next_index += 1
            self.next_group += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "next_group": self.next_group,
                "next_index": self.next_index, "buffer": [[s.to_dict() for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self.next_group, self.next_index = state["next_group"], state["next_index"]
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state["buffer"]]
        self._order = self._epoch_order()


def make_eval_source(config, tokenizer, spec: str) -> PromptDataSource:
    records, filtered = load_prompts(config, tokenizer, spec, input_key=config.eval_input_key,
                                     label_key=config.eval_label_key, eval_set=True)
    return PromptDataSource(records, config.n_samples_per_eval_prompt, num_filtered=filtered)
