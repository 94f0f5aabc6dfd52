"""A hook's answer is checked right after it returns, naming the plugin and the hook; a failed step leaves no
task behind; the rollout's watchdog names what it waits on, and a blocked event loop is reported within the
rollout's deadline (no engines, no Ray: the hooks are called through the real plugin manager)."""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import re
import time

import pytest
import torch

from slimecore import aio, hookimpl
from slimecore.answers import HookAnswerError
from slimecore.config import Config
from slimecore.errors import describe
from slimecore.plugins import load_plugins
from slimecore.rollout.groups import GroupRunner
from slimecore.rollout.hook_args import SampleHooks
from slimecore.types import Sample, Status
from slimecore.watchdog import LoopThread, RolloutTimeoutError


def _group(n: int = 4, status: Status = Status.PENDING) -> list[Sample]:
    return [Sample(group_index=0, index=i, prompt="p", tokens=[1, 2, 3], label="1", status=status) for i in range(n)]


GENERATED = Status.COMPLETED  # a group whose responses are there: the rollout goes on to the rewards


class Rewarding:
    """A reward plugin answering ``answer`` (the test sets it)."""

    __name__ = "rewarding"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    async def slime_reward(self, config, sample):
        return self.answer


class Generating:
    """A generate hook answering 8 response tokens; ``log_probs`` of them, set directly or appended."""

    __name__ = "generating"

    def __init__(self, log_probs: int, append: bool):
        self.log_probs, self.append = log_probs, append

    @hookimpl
    async def slime_generate(self, config, sample):
        await asyncio.sleep(0)
        if self.append:
            sample.append_response_tokens(list(range(8)), [-0.5] * self.log_probs, trainable=True)
        else:
            sample.tokens += list(range(8))
            sample.response_length, sample.rollout_log_probs = 8, [-0.5] * self.log_probs
        return sample


def _runner(plugin, **config) -> GroupRunner:
    hooks = load_plugins([], extra=[plugin])
    return GroupRunner(Config.make(rm_type="math", **config), None, SampleHooks(hooks), 0, False,
                       asyncio.Semaphore(8))


@pytest.mark.parametrize("answer,expected", [
    ("good", "plugin 'rewarding': slime_reward returned 'good' (a str); a reward is a float, a dict of floats"),
    (torch.tensor([1.0, 0.0]), "slime_reward returned a torch.Tensor of shape (2,); return .item() of a one-element"),
    ({"score": [1]}, "slime_reward returned a dict whose 'score' is not a number ([1] (a list))"),
])
def test_a_reward_of_the_wrong_type_fails_its_sample_naming_plugin_and_hook(answer, expected, caplog):
    runner = _runner(Rewarding(answer))
    sample = _group(1)[0]
    asyncio.run(runner._reward(sample))
    assert sample.status == Status.FAILED and runner.reward_failures == 1
    assert expected in sample.metadata["reward_error"], sample.metadata["reward_error"]


def test_numbers_and_dicts_of_numbers_are_rewards():
    for answer in (1, 0.5, True, {"score": 1.0, "pred": "42"}):
        runner = _runner(Rewarding(answer), reward_key="score")
        sample = _group(1)[0]
        asyncio.run(runner._reward(sample))
        assert sample.status != Status.FAILED and sample.reward == answer


@pytest.mark.parametrize("append", [False, True], ids=["set directly", "append_response_tokens"])
def test_a_generate_hook_with_8_tokens_and_7_log_probs_is_one_error_naming_it(append, caplog):
    runner = _runner(Generating(7, append))
    loop = asyncio.new_event_loop()
    unretrieved = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
    with pytest.raises(Exception) as err:
        loop.run_until_complete(runner.run(_group(4)))
    gc.collect()
    loop.close()
    failure = describe(err.value)
    assert (failure.plugin, failure.hook) == ("generating", "slime_generate")
    if append:  # the plugin's own call raised: its message, blamed on it
        assert "8 tokens but 7 log-probs" in failure.text()
    else:
        assert isinstance(err.value, HookAnswerError)
        assert "rollout_log_probs has 7 entries but response_length is 8" in failure.text()
        assert "use Sample.append_response_tokens" in failure.text()
    assert unretrieved == []  # the group's other 3 samples' failures were retrieved, not left to the collector


def test_a_wrong_answer_crosses_ray_pickled_with_plugin_and_hook():
    error = pickle.loads(pickle.dumps(HookAnswerError("p", "slime_reward", "'x' (a str)")))
    assert (error.plugin, error.hook) == ("p", "slime_reward")
    assert str(error) == "plugin 'p': slime_reward returned 'x' (a str)"
    assert describe(error).text().startswith("slime_reward returned 'x' (a str)\n  (from plugin 'p', hook slime_reward")


def test_gather_cancels_the_rest_on_the_first_failure():
    finished = []

    async def fail():
        raise ValueError("first")

    async def slow():
        await asyncio.sleep(5)
        finished.append(True)

    async def main():
        start = time.perf_counter()
        with pytest.raises(ValueError, match="first"):
            await aio.gather(fail(), slow(), slow())
        return time.perf_counter() - start

    assert asyncio.run(main()) < 1 and finished == []


class Blocking:
    """An async reward that blocks the event loop (a time.sleep where an await asyncio.sleep belongs)."""

    __name__ = "blocking"

    @hookimpl
    async def slime_reward(self, config, sample):
        time.sleep(5)
        return 1.0


class NeverAnswers:
    __name__ = "never_answers"

    @hookimpl
    async def slime_reward(self, config, sample):
        await asyncio.sleep(3600)


def test_a_blocked_event_loop_is_reported_within_the_rollout_timeout(caplog):
    runner = _runner(Blocking())
    loop = LoopThread(asyncio.new_event_loop(), stall=1.0)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, "slimecore.rollout"), pytest.raises(RolloutTimeoutError) as err:
        loop.run_until_complete(runner.run(_group(1, GENERATED)), timeout=3, what="rollout 0 (--rollout-timeout)")
    took = time.perf_counter() - start
    message = " ".join(str(err.value).split())
    assert took < 4, took  # the deadline held although the loop never turned
    assert message.startswith("rollout 0 (--rollout-timeout) did not finish within 3 s: waiting on plugin 'blocking' "
                              "slime_reward for sample 0"), message
    assert "The event loop has not turned for" in message and "test_hook_answers.py:" in message
    assert "in slime_reward" in message and "await asyncio.to_thread" in message
    assert any("has not turned" in r.getMessage() for r in caplog.records)  # said by the watchdog before the deadline
    time.sleep(2.5)  # the plugin's sleep ends; the cancelled step unwinds and the loop stops cleanly
    loop.close()
    assert not loop.thread.is_alive()


def test_a_deadline_names_the_hook_calls_in_flight_and_long_waits_are_said(caplog):
    runner = _runner(NeverAnswers())
    loop = LoopThread(asyncio.new_event_loop(), report_every=1.0)
    with caplog.at_level(logging.WARNING, "slimecore.rollout"), pytest.raises(RolloutTimeoutError) as err:
        loop.run_until_complete(runner.run(_group(2, GENERATED)), timeout=2.5, what="rollout 4 (--rollout-timeout)")
    assert re.fullmatch(r"rollout 4 \(--rollout-timeout\) did not finish within 2.5 s: waiting on plugin "
                        r"'never_answers' slime_reward for sample 0 \(\d s\); plugin 'never_answers' slime_reward "
                        r"for sample 1 \(\d s\)", str(err.value)), str(err.value)
    assert "has not turned" not in str(err.value)
    assert any("still waiting on plugin 'never_answers' slime_reward for sample" in r.getMessage()
               for r in caplog.records)
    loop.close()


def test_only_the_innermost_hook_calls_are_named():
    from slimecore.watchdog import in_flight, waiting

    async def reward(index: int):
        with waiting("judge", "slime_reward", {"sample": Sample(index=index)}):
            await asyncio.sleep(0.3)

    async def rollout():
        with waiting("slimecore.defaults.rollout", "slime_rollout", {}):  # waits on the rewards it started
            tasks = [asyncio.ensure_future(reward(i)) for i in range(2)]
            await asyncio.sleep(0.1)
            named = in_flight()
            await asyncio.gather(*tasks)
            return named

    named = asyncio.run(rollout())
    assert re.fullmatch(r"plugin 'judge' slime_reward for sample 0 \(0 s\); plugin 'judge' slime_reward for sample 1 "
                        r"\(0 s\)", named), named
    assert in_flight() == ""

