"""The difficulty controller: levels move with the pass rate of the current level's window, only after enough
results, within 0..top, in sample-index order whatever order rewards arrived in, and survive a checkpoint."""

import random

import pytest

from slime_reasoning_gym.difficulty import DifficultyController, Thresholds

RULE = Thresholds(window=8, min_samples=4, raise_at=0.75, lower_at=0.25)


def feed(controller, task, results, start_index=0):
    for offset, passed in enumerate(results):
        controller.record(start_index + offset, task, controller.level(task), 1.0 if passed else 0.0)
    controller.apply()


def test_a_level_rises_at_the_raise_threshold_and_falls_at_the_lower_one():
    c = DifficultyController({"a": 3, "b": 3}, start_level=1, thresholds=RULE)
    feed(c, "a", [1, 1, 1])  # 3 results: below --rg-min-samples, nothing moves however good
    assert c.level("a") == 1 and c.pass_rate("a") == 1.0
    feed(c, "a", [0], start_index=3)  # 4 results at 3/4 = raise_at: up, window emptied
    assert c.level("a") == 2 and c.pass_rate("a") is None and c.changes["a"] == 1
    feed(c, "b", [0, 0, 0, 1])  # 1/4 = lower_at: down
    assert c.level("b") == 0
    feed(c, "b", [0, 0, 0, 0, 0])  # at the bottom it stays
    assert c.level("b") == 0 and c.changes["b"] == 1
    feed(c, "b", [1, 0, 1, 0])  # the window keeps the last 8 results: 2/8
    assert c.level("b") == 0 and c.pass_rate("b") == 0.25 and len(c.windows["b"]) == 8


def test_top_level_holds_and_a_task_without_curriculum_never_moves():
    c = DifficultyController({"a": 1, "fixed": 0}, start_level=5, thresholds=RULE)
    assert c.level("a") == 1 and c.level("fixed") == 0  # the start level is clamped to each task's top
    feed(c, "a", [1] * 8)
    feed(c, "fixed", [1] * 8)
    assert (c.level("a"), c.level("fixed")) == (1, 0) and c.changes == {"a": 0, "fixed": 0}


def test_results_of_another_level_are_dropped():
    c = DifficultyController({"a": 3}, start_level=0, thresholds=RULE)
    for index in range(6):  # drawn at level 2 (before a change, as in async rollout): no evidence for level 0
        c.record(index, "a", 2, 1.0)
    c.apply()
    assert c.pass_rate("a") is None and c.level("a") == 0


def test_the_order_rewards_finish_in_does_not_matter():
    results = [(i, "a", 0, float(i % 3 == 0)) for i in range(40)] + [(40 + i, "a", 0, 1.0) for i in range(8)]
    levels = set()
    for seed in range(5):
        c = DifficultyController({"a": 5}, start_level=0, thresholds=RULE)
        shuffled = results[:]
        random.Random(seed).shuffle(shuffled)
        for index, task, level, score in shuffled:
            c.record(index, task, level, score)
        c.apply()
        levels.add((c.level("a"), tuple(c.windows["a"]), c.changes["a"]))
    assert len(levels) == 1


def test_pass_score_and_fixed_levels():
    c = DifficultyController({"a": 3}, 0, Thresholds(window=4, min_samples=4, raise_at=0.5, lower_at=0.0,
                                                     pass_score=0.9), adapt=False)
    for index, score in enumerate([0.95, 0.5, 0.9, 0.1]):  # partial credit below --rg-pass-score fails
        c.record(index, "a", 0, score)
    c.apply()
    assert c.pass_rate("a") == 0.5 and c.level("a") == 0  # --no-rg-adapt: the rate is kept, the level stays


def test_state_round_trips_and_a_new_task_starts_fresh():
    c = DifficultyController({"a": 3, "b": 3}, 0, RULE)
    feed(c, "a", [1, 1, 1, 1, 1])
    c.record(99, "b", 0, 1.0)  # recorded, not applied yet: it must survive the checkpoint
    state = c.state_dict()
    resumed = DifficultyController({"a": 3, "c": 2}, 0, RULE)
    resumed.load_state_dict(state)
    assert resumed.level("a") == 1 and list(resumed.windows["a"]) == list(c.windows["a"])
    assert resumed.level("c") == 0 and resumed.pending == []  # b is no longer configured: its result is dropped
    again = DifficultyController({"a": 3, "b": 3}, 0, RULE)
    again.load_state_dict(state)
    again.apply()
    c.apply()
    assert again.state_dict() == c.state_dict()


@pytest.mark.parametrize("rule, message", [
    (Thresholds(window=4, min_samples=8), "--rg-min-samples"),
    (Thresholds(min_samples=0), "--rg-min-samples"),
    (Thresholds(raise_at=0.3, lower_at=0.3), "--rg-lower-at"),
    (Thresholds(raise_at=1.5), "--rg-raise-at"),
])
def test_bad_thresholds_are_named(rule, message):
    assert message in rule.check()
