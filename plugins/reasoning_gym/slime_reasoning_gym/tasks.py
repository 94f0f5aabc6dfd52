"""reasoning-gym tasks at a difficulty level, and the problems (entries) drawn from them.

A task is one registered reasoning-gym dataset (``reasoning_gym.factory.DATASETS``). Its level ``L`` is the
dataset config its curriculum gives at global level ``L`` (``BaseCurriculum.set_global_level``: every
attribute at ``L``, or at its own top when it has fewer levels), read through reasoning-gym's
``DefaultCurriculumContext`` in ``--rg-range-mode`` (``inclusive``: a range attribute spans levels 0..L;
``upper_bound``: only its level-L segment). ``--rg-task-config`` values are fixed and win over the curriculum.
A task without a curriculum has one level, its default config.

An entry is identified by ``(task, config, index)``: ``config`` is the dataset config as plain JSON and the
entry is ``create_dataset(task, **config)[index]``. Samples carry exactly that in their metadata, so the reward
can rebuild the entry (and its ``score_answer``) from the sample alone, in any process and after a resume.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from functools import lru_cache

import reasoning_gym
from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode
from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum

RANGE_MODES = ("inclusive", "upper_bound")


class TaskError(ValueError):
    """A task name or task config that reasoning-gym does not accept; the message says what to change."""


def check_task_name(name: str) -> None:
    if name not in DATASETS:
        hint = difflib.get_close_matches(name, DATASETS, n=3)
        raise TaskError(f"--rg-tasks: {name!r} is not a reasoning-gym dataset"
                        + (f" (did you mean {', '.join(hint)}?)" if hint else "")
                        + f"; reasoning-gym {reasoning_gym.__version__} has {len(DATASETS)}, listed by "
                        "`python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'`")


class Task:
    """One reasoning-gym dataset with its curriculum levels. ``fixed`` holds config fields set by the user."""

    def __init__(self, name: str, fixed: dict | None = None, range_mode: str = "inclusive"):
        check_task_name(name)
        self.name, self.fixed = name, dict(fixed or {})
        config_cls = DATASETS[name][1]
        fields = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(self.fixed) - fields)
        if unknown:
            raise TaskError(f"--rg-task-config {name}: {unknown} are not fields of {config_cls.__name__} "
                            f"(its fields: {', '.join(sorted(fields))})")
        self.curriculum = create_curriculum(name) if name in CURRICULA else None
        self.context = DefaultCurriculumContext(mode=RangeAttributeMode(range_mode))
        attributes = self.curriculum.attributes.values() if self.curriculum else ()
        self.top_level = max((len(attr.levels) - 1 for attr in attributes), default=0)

    def config(self, level: int, seed: int, size: int) -> dict:
        """The dataset config at ``level`` as plain JSON (what samples carry and ``dataset`` takes)."""
        if not 0 <= level <= self.top_level:
            raise TaskError(f"task {self.name}: level {level} is outside 0..{self.top_level}")
        defaults = {**self.fixed, "seed": seed, "size": size}
        if self.curriculum is None:
            config = DATASETS[self.name][1](**defaults)
        else:
            self.curriculum.set_global_level(level)
            config = self.curriculum.generate_configuration(defaults, context=self.context)
            for key, value in self.fixed.items():  # the curriculum overwrites the attributes it drives
                setattr(config, key, value)
        plain = json.loads(json.dumps(dataclasses.asdict(config)))
        try:
            dataset(self.name, json.dumps(plain, sort_keys=True))
        except (ValueError, TypeError, AssertionError) as exc:
            raise TaskError(f"task {self.name} at level {level}: reasoning-gym rejects the config {plain} "
                            f"({type(exc).__name__}: {exc}); fix --rg-task-config") from exc
        return plain


@lru_cache(maxsize=256)
def dataset(name: str, config_json: str):
    """The reasoning-gym dataset for a task and its config (JSON text, so it can be a cache key)."""
    return reasoning_gym.create_dataset(name, **json.loads(config_json))


def entry(name: str, config: dict, index: int) -> tuple[dict, object]:
    """Problem ``index`` of the task's dataset with ``config``, and the dataset (whose ``score_answer`` grades
    it)."""
    data = dataset(name, json.dumps(config, sort_keys=True))
    return data[index], data
