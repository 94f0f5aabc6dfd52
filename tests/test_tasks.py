"""Built-in tasks: deterministic rows, answerable questions, and the reward table of each task."""

from __future__ import annotations

import json

import pytest

from slimecore.data.tasks import TASKS, Task, get_task, last_number, write_task_jsonl


@pytest.mark.parametrize("task,response,label,reward", [
    # last number wins, wherever the words are
    ("arithmetic", "17", "17", 1.0), ("arithmetic", "The answer is 17.", "17", 1.0),
    ("arithmetic", "12 + 5 = 17", "17", 1.0), ("arithmetic", "17.0", "17", 1.0),
    ("arithmetic", "17 is the answer, not 12", "17", 0.0), ("arithmetic", "seventeen", "17", 0.0),
    ("arithmetic", "", "17", 0.0), ("arithmetic", "170", "17", 0.0), ("arithmetic", "30-13", "17", 0.0),
    ("arithmetic", "12-5=7", "7", 1.0), ("arithmetic", "-7", "-7", 1.0),
    ("compare", "The answer is 73.", "73", 1.0), ("compare", "73 is larger than 12", "73", 0.0),
    ("compare", "no idea", "73", 0.0), ("counting", "3", "3", 1.0), ("counting", "There are 3 r's.", "3", 1.0),
    # sorting: exactly the sorted integers, in order, any separators
    ("sorting", "1, 5, 9", "1, 5, 9", 1.0), ("sorting", "1 5 9", "1, 5, 9", 1.0),
    ("sorting", "[1,5,9]", "1, 5, 9", 1.0), ("sorting", "1, 9, 5", "1, 5, 9", 0.0),
    ("sorting", "1, 5", "1, 5, 9", 0.0), ("sorting", "1, 5, 9, 10", "1, 5, 9", 0.0),
    # repeat: the word alone
    ("repeat", " Apple.", "apple", 1.0), ("repeat", '"apple"', "apple", 1.0), ("repeat", "apple apple", "apple", 0.0),
    ("repeat", "Sure: apple", "apple", 0.0),
])
def test_reward_table(task, response, label, reward):
    assert TASKS[task].reward(response, label) == reward


def test_last_number():
    assert last_number("a 3 b 4.5 c") == 4.5 and last_number("none") is None and last_number("x-2") == -2


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_are_deterministic_and_solvable(name):
    task = TASKS[name]
    rows = task.make_rows(50, seed=3)
    assert rows == task.make_rows(50, seed=3) and rows != task.make_rows(50, seed=4)
    assert rows[:10] == task.make_rows(10, seed=3)  # a prefix does not depend on n
    for row in rows:
        assert set(row) == {"input", "label", "metadata"} and row["metadata"] == {"rm_type": name}
        assert task.reward(row["label"], row["label"]) == 1.0  # the label itself is a perfect answer
        assert len(row["input"]) < 120, "prompts stay short so a 135M model on a CPU can learn them"


def test_answers_are_right():
    for row in TASKS["arithmetic"].make_rows(200, seed=0):
        question = row["input"].removeprefix("What is ").split("?")[0]
        a, op, b = question.split()
        assert int(row["label"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert 1 <= int(a) <= 50 and 1 <= int(b) <= 50 and "Answer with only the number." in row["input"]
    for row in TASKS["counting"].make_rows(50, seed=0):
        letter, word = row["input"].split("'")[1], row["input"].split("'")[3]
        assert int(row["label"]) == word.count(letter) >= 1
    for row in TASKS["sorting"].make_rows(50, seed=0):
        numbers = [int(x) for x in row["input"].split(": ")[1].split(".")[0].split(", ")]
        assert row["label"] == ", ".join(map(str, sorted(numbers)))
    for row in TASKS["compare"].make_rows(50, seed=0):
        a, b = row["input"].split(": ")[1].split("?")[0].split(" or ")
        assert int(row["label"]) == max(int(a), int(b))


def test_write_task_jsonl_and_unknown_task(tmp_path):
    path = write_task_jsonl("sorting", tmp_path / "sub" / "s.jsonl", 5, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == TASKS["sorting"].make_rows(5, 1)
    assert write_task_jsonl(TASKS["repeat"], tmp_path / "r.jsonl", 2, 0).read_text().count("\n") == 2
    with pytest.raises(ValueError, match="unknown built-in task 'nope'; built-in tasks: arithmetic, "):
        get_task("nope")
    assert isinstance(get_task("arithmetic"), Task)
