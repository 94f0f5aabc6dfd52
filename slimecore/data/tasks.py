"""Built-in verifiable tasks, generated from a seed, so a run needs no data files.

Each task makes rows ``{"input", "label", "metadata": {"rm_type": name}}`` and scores a response with
its own rule-based reward, 0.0 or 1.0 (no partial credit):

- ``compare``, ``arithmetic``, ``counting``: the **last number** in the response must equal the label.
  "The answer is 17." and "12 + 5 = 17" score 1; "17 is the answer, not 12" scores 0. The last number
  (rather than the first) is the usual rule for math rewards: models state the result at the end.
- ``sorting``: the integers in the response, in order, must be exactly the sorted list.
- ``repeat``: the response must be the word (case, surrounding quotes/spaces and a final period ignored).

Prompts are short and end with an explicit answer format ("Answer with only the number."), so a 135M
instruct model starts with a middling reward that RL can raise within minutes on a CPU.
``recommended`` holds the run settings used with the task when the user does not set them (the laptop
quick start); the CLI prints which it applied.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# A minus sign right after a digit is an operator ("12-5"), not a sign; decimals parse so "17.0" counts.
_NUMBER = re.compile(r"(?<!\d)-?\d+(?:\.\d+)?")
_INT = re.compile(r"(?<!\d)-?\d+")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``None`` if there is none)."""
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


def last_number_reward(response: str, label) -> float:
    """1.0 iff the last number in the response equals the label."""
    value = last_number(response)
    return float(value is not None and value == float(label))


def sorted_list_reward(response: str, label) -> float:
    """1.0 iff the integers in the response, in order, are exactly the label's (a comma-separated list)."""
    return float([int(x) for x in _INT.findall(response)] == [int(x) for x in str(label).split(",")])


def exact_word_reward(response: str, label) -> float:
    """1.0 iff the response is the label word (case-insensitive; quotes, spaces and a final . or ! ignored)."""
    return float(response.strip().strip("\"'").rstrip(".!").strip().lower() == str(label).lower())


@dataclass(frozen=True)
class Task:
    """A named generator of ``(question, answer)`` pairs plus the reward that checks an answer."""

    name: str
    description: str
    make_row: Callable[[random.Random], tuple[str, str]]
    reward: Callable[[str, object], float]
    recommended: dict = field(default_factory=dict)

    def make_rows(self, n: int, seed: int) -> list[dict]:
        """``n`` rows, the same for the same ``seed`` on every machine and Python version."""
        rng = random.Random(f"{self.name}:{seed}")  # str seeds hash with sha512: stable across processes
        rows = []
        for _ in range(n):
            question, answer = self.make_row(rng)
            rows.append({"input": question, "label": answer, "metadata": {"rm_type": self.name}})
        return rows


def _compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger: {a} or {b}? Answer with only the number.", str(max(a, b))


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    if rng.random() < 0.5:
        return f"What is {a} + {b}? Answer with only the number.", str(a + b)
    a, b = max(a, b), min(a, b)  # results stay non-negative: small models stumble on signs
    return f"What is {a} - {b}? Answer with only the number.", str(a - b)


_WORDS = ("banana", "letter", "mississippi", "pepper", "balloon", "committee", "assessment", "coffee", "bookkeeper",
          "parallel", "address", "success", "tomorrow", "apple", "strawberry", "necessary")


def _counting(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_WORDS)
    letter = rng.choice(sorted(set(word)))
    question = f"How many times does the letter '{letter}' appear in '{word}'? Answer with only the number."
    return question, str(word.count(letter))


def _sorting(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 5))]
    question = (f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}. "
                "Answer with only the sorted list.")
    return question, ", ".join(map(str, sorted(numbers)))


_REPEAT_WORDS = ("apple", "river", "stone", "cloud", "tiger", "music", "green", "house", "light", "paper")


def _repeat(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_REPEAT_WORDS)
    return f"Repeat this word exactly, and nothing else: {word}", word


QUICKSTART = {"rollout_batch_size": 8, "n_samples_per_prompt": 8, "num_rollout": 16, "rollout_max_response_len": 16,
              "lr": 1e-5, "apply_chat_template": True, "micro_batch_size": 16}

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("compare", "Pick the larger of two 2-digit numbers.", _compare, last_number_reward, QUICKSTART),
    Task("arithmetic", "Add or subtract two numbers from 1 to 50.", _arithmetic, last_number_reward, QUICKSTART),
    Task("counting", "Count a letter in a word.", _counting, last_number_reward, QUICKSTART),
    Task("sorting", "Sort 3-5 numbers; answer comma-separated.", _sorting, sorted_list_reward,
         {**QUICKSTART, "rollout_max_response_len": 32}),
    Task("repeat", "Repeat a word.", _repeat, exact_word_reward, QUICKSTART),
)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def write_task_jsonl(task: Task | str, path: str | Path, n: int, seed: int) -> Path:
    """Write ``n`` rows of a built-in task to a jsonl file usable as ``--prompt-data`` (``--label-key label``)."""
    task = get_task(task) if isinstance(task, str) else task
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in task.make_rows(n, seed):
            f.write(json.dumps(row) + "\n")
    return path
