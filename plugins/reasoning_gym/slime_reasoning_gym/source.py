"""The data source: reasoning-gym problems drawn at each task's current difficulty, without end.

Group ``g`` takes its task from ``random.Random(seed, g)`` (uniform over ``--rg-tasks``) and the task's next
problem at its current level: the ``k``-th problem drawn from a task is entry ``k mod --task-size`` of the
task's dataset at that level (seeded by ``--rollout-seed``). The state (group and sample counters, problems
drawn per task, the difficulty controller, the buffer of aborted groups) round-trips, so a resumed run draws
the problems and levels an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import logging
import random

from slimecore.data.source import BufferFilter, pop_first
from slimecore.types import DataSource, Sample

from slime_reasoning_gym.difficulty import DifficultyController
from slime_reasoning_gym.tasks import Task, entry

log = logging.getLogger("slime_reasoning_gym")
METADATA_KEY = "reasoning_gym"  # sample.metadata[METADATA_KEY] = {"task", "level", "config", "index"}


class ReasoningGymSource(DataSource):
    """``render(messages) -> (prompt, token ids)`` turns a problem's chat messages into the engine's prompt;
    problems whose prompt has more than ``max_prompt_len`` tokens are skipped (and counted)."""

    def __init__(self, tasks: list[Task], controller: DifficultyController, render, *, n_samples_per_prompt: int,
                 system_prompt: str | None, seed: int, size: int, max_prompt_len: int | None = None,
                 buffer_filter: BufferFilter | None = None):
        self.tasks = {task.name: task for task in tasks}
        self.names = [task.name for task in tasks]
        self.controller, self.render = controller, render
        self.n_samples_per_prompt, self.system_prompt = n_samples_per_prompt, system_prompt
        self.seed, self.size, self.max_prompt_len = seed, size, max_prompt_len
        self.buffer_filter = buffer_filter or pop_first
        self.buffer: list[list[Sample]] = []
        self.drawn = {name: 0 for name in self.names}  # problems drawn per task, over all levels
        self.too_long = {name: 0 for name in self.names}
        self.next_group_index, self.next_index = 0, 0
        self._configs: dict[tuple[str, int], dict] = {}

    def __len__(self) -> int:
        """Problems per "epoch" (only used to size a run without --num-rollout): ``--task-size``."""
        return self.size

    def _config(self, name: str, level: int) -> dict:
        if (name, level) not in self._configs:
            self._configs[name, level] = self.tasks[name].config(level, self.seed, self.size)
        return self._configs[name, level]

    def _draw(self, name: str) -> tuple[dict, dict]:
        """The task's next problem that fits ``max_prompt_len``: (prompt record, reasoning_gym metadata)."""
        level = self.controller.level(name)
        config = self._config(name, level)
        for _ in range(100):
            index = self.drawn[name] % self.size
            self.drawn[name] += 1
            problem, _ = entry(name, config, index)
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": problem["question"]}]
            prompt, tokens = self.render(messages)
            if self.max_prompt_len is None or len(tokens) <= self.max_prompt_len:
                meta = {"task": name, "level": level, "config": config, "index": index}
                return {"prompt": prompt, "tokens": tokens, "label": problem["answer"]}, meta
            self.too_long[name] += 1
        raise ValueError(f"reasoning_gym task {name} at level {level}: 100 problems in a row are longer than "
                         f"--rollout-max-prompt-len {self.max_prompt_len} tokens; raise it or drop the task")

    def _new_group(self) -> list[Sample]:
        name = random.Random(f"{self.seed}/{self.next_group_index}").choice(self.names)
        record, meta = self._draw(name)
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(Sample(group_index=self.next_group_index, index=self.next_index, prompt=record["prompt"],
                                tokens=list(record["tokens"]), label=record["label"],
                                metadata={METADATA_KEY: copy.deepcopy(meta)}))
            self.next_index += 1
        self.next_group_index += 1
        return group

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        self.controller.apply()  # the results of the last step decide this step's levels
        groups = self.buffer_filter(self.buffer, num_groups) if self.buffer else []
        if len(groups) > num_groups:
            raise ValueError(f"the buffer filter returned {len(groups)} groups for a request of {num_groups}; "
                             "a slime_buffer_filter must return at most num_groups groups")
        groups += [self._new_group() for _ in range(num_groups - len(groups))]
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)

    def state_dict(self) -> dict:
        return {"sample_group_index": self.next_group_index, "sample_index": self.next_index,
                "drawn": dict(self.drawn), "too_long": dict(self.too_long), "difficulty": self.controller.state_dict(),
                "buffer": [[s.to_dict() for s in group] for group in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.next_group_index, self.next_index = state["sample_group_index"], state["sample_index"]
        for name in self.names:
            self.drawn[name] = state["drawn"].get(name, 0)
            self.too_long[name] = state["too_long"].get(name, 0)
        self.controller.load_state_dict(state["difficulty"])
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state["buffer"]]
