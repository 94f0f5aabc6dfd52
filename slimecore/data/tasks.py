"""Built-in verifiable tasks, generated from a seed, so a run needs no data files.

Each task makes rows ``{"input", "label", "metadata": {"rm_type": name}}`` and scores a response with
its own rule-based reward in [0, 1]. ``recommended`` holds the settings a run on the task uses when the
user does not set them (the laptop quick start); the CLI prints which it applied.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def _last_integer_equals(response: str, label) -> float:
    """1.0 iff the last integer in the response equals the label (so "The answer is 42." counts)."""
    value = last_integer(response)
    return float(value is not None and value == int(label))


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    make_row: Callable[[random.Random], tuple[str, str]]
    reward: Callable[[str, object], float]
    recommended: dict = field(default_factory=dict)

    def make_rows(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(f"{self.name}:{seed}")
        rows = []
        for _ in range(n):
            question, answer = self.make_row(rng)
            rows.append({"input": question, "label": answer, "metadata": {"rm_type": self.name}})
        return rows


def _compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(10, 99), 2)
    return f"Which number is larger: {a} or {b}? Answer with only the number.", str(max(a, b))


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? Answer with only the number.", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}? Answer with only the number.", str(a - b)


_WORDS = ("banana", "letter", "mississippi", "pepper", "balloon", "committee", "assessment", "coffee", "bookkeeper",
          "parallel", "address", "success", "tomorrow", "apple", "strawberry", "necessary")


def _counting(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_WORDS)
    letter = rng.choice(sorted(set(word)))
    return f"How many times does the letter '{letter}' appear in '{word}'? Answer with only the number.", \
        str(word.count(letter))


def _sorting(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 5))]
    shown = ", ".join(map(str, numbers))
    return f"Sort these numbers from smallest to largest: {shown}. Answer with only the sorted list.", \
        ", ".join(map(str, sorted(numbers)))


def _sorting_reward(response: str, label) -> float:
    """1.0 iff the integers in the response, in order, are exactly the sorted list."""
    return float([int(x) for x in _INT.findall(response)] == [int(x) for x in str(label).split(",")])


_REPEAT_WORDS = ("apple", "river", "stone", "cloud", "tiger", "music", "green", "house", "light", "paper")


def _repeat(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_REPEAT_WORDS)
    return f"Repeat this word exactly, and nothing else: {word}", word


def _repeat_reward(response: str, label) -> float:
    """1.0 iff the response is the word (case-insensitive; surrounding spaces, quotes, final period ignored)."""
    return float(response.strip().strip("\"'").rstrip(".!").strip().lower() == str(label).lower())


QUICKSTART = {"rollout_batch_size": 8, "n_samples_per_prompt": 8, "num_rollout": 16, "rollout_max_response_len": 16,
              "lr": 1e-5, "apply_chat_template": True, "micro_batch_size": 16}

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("compare", "Pick the larger of two 2-digit numbers.", _compare, _last_integer_equals, QUICKSTART),
    Task("arithmetic", "Add or subtract two numbers up to 50.", _arithmetic, _last_integer_equals, QUICKSTART),
    Task("counting", "Count a letter in a word.", _counting, _last_integer_equals, QUICKSTART),
    Task("sorting", "Sort 3-5 numbers.", _sorting, _sorting_reward, {**QUICKSTART, "rollout_max_response_len": 32}),
    Task("repeat", "Repeat a word.", _repeat, _repeat_reward, QUICKSTART),
)}


def write_task_jsonl(task_name: str, path: str | Path, n: int, seed: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in TASKS[task_name].make_rows(n, seed):
            f.write(json.dumps(row) + "\n")
    return path
