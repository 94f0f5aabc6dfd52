"""Per-task difficulty that follows the policy's pass rate (adaptive environments, as in RLVE).

Each task has a level, 0 being the easiest of its reasoning-gym curriculum. The results of samples drawn at a
task's current level go into a rolling window of its last ``window`` results (pass: score >= ``pass_score``).
Once the window holds ``min_samples`` results or more:

- pass rate >= ``raise_at``: one level up (unless at the top), window emptied;
- pass rate <= ``lower_at``: one level down (unless at 0), window emptied.

Results of samples drawn at another level (generated before a change, as in async rollout) are dropped: they
say nothing about the current level. Results are recorded as rewards come in and applied by ``apply`` at the
start of the next draw, sorted by sample index, so a level never depends on the order in which rewards finished
and every group of one step sees one level per task.

RLVE (Zeng et al., 2025) samples from a range of difficulties, counts only problems at its top and only raises
it. Here one level is one reasoning-gym curriculum configuration (which itself spans a range of problem sizes,
see ``--rg-range-mode``), every problem drawn from it counts, and a level also comes down when the policy fails
it, so a task that was raised too early is not lost for the rest of the run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    window: int = 64
    min_samples: int = 32
    raise_at: float = 0.8
    lower_at: float = 0.2
    pass_score: float = 1.0

    def check(self) -> str | None:
        """What is wrong with these thresholds, as a sentence naming the flags, or None."""
        if not 1 <= self.min_samples <= self.window:
            return f"need 1 <= --rg-min-samples ({self.min_samples}) <= --rg-window ({self.window})"
        if not 0.0 <= self.lower_at < self.raise_at <= 1.0:
            return f"need 0 <= --rg-lower-at ({self.lower_at}) < --rg-raise-at ({self.raise_at}) <= 1"
        return None


class DifficultyController:
    """Levels of several tasks. ``top_levels[task]`` is the task's highest level (0 for a task without a
    curriculum, which then never moves); with ``adapt=False`` no level moves but pass rates are still kept."""

    def __init__(self, top_levels: dict[str, int], start_level: int, thresholds: Thresholds, adapt: bool = True):
        self.top_levels, self.thresholds, self.adapt = dict(top_levels), thresholds, adapt
        self.levels = {task: min(start_level, top) for task, top in self.top_levels.items()}
        self.windows = {task: deque(maxlen=thresholds.window) for task in self.top_levels}
        self.pending: list[tuple[int, str, int, bool]] = []  # (sample index, task, level, passed)
        self.changes = {task: 0 for task in self.top_levels}  # level moves so far, per task

    def level(self, task: str) -> int:
        return self.levels[task]

    def record(self, index: int, task: str, level: int, score: float) -> None:
        """One scored sample drawn at ``level`` of ``task``; takes effect at the next ``apply``."""
        self.pending.append((index, task, level, score >= self.thresholds.pass_score))

    def apply(self) -> None:
        """Fold the recorded results into the windows, in sample-index order, moving levels as they fill."""
        for _, task, level, passed in sorted(self.pending, key=lambda result: result[0]):
            if level != self.levels[task]:
                continue
            window = self.windows[task]
            window.append(passed)
            if not self.adapt or len(window) < self.thresholds.min_samples:
                continue
            rate = sum(window) / len(window)
            step = (1 if rate >= self.thresholds.raise_at else -1 if rate <= self.thresholds.lower_at else 0)
            new_level = min(max(level + step, 0), self.top_levels[task])
            if new_level != level:
                self.levels[task] = new_level
                self.changes[task] += 1
                window.clear()
        self.pending.clear()

    def pass_rate(self, task: str) -> float | None:
        """Pass rate of the task's window (results at its current level), None while it is empty."""
        window = self.windows[task]
        return sum(window) / len(window) if window else None

    def state_dict(self) -> dict:
        return {"levels": dict(self.levels), "windows": {t: list(w) for t, w in self.windows.items()},
                "pending": [list(p) for p in self.pending], "changes": dict(self.changes)}

    def load_state_dict(self, state: dict) -> None:
        """Tasks of the checkpoint that are still configured keep their level and window; new ones start fresh."""
        for task in self.top_levels:
            if task in state["levels"]:
                self.levels[task] = min(state["levels"][task], self.top_levels[task])
                self.windows[task] = deque(state["windows"][task], maxlen=self.thresholds.window)
                self.changes[task] = state["changes"][task]
        self.pending = [tuple(p) for p in state["pending"] if p[1] in self.top_levels]
