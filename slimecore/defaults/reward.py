"""Built-in reward plugin: slime's reward hub, chosen by ``sample.metadata["rm_type"]``, then ``--rm-type``.

Types (implemented in ``slimecore.rewards``; each module's docstring gives its exact rule):

| type | reward |
|---|---|
| ``math`` | 1/0: last ``\\boxed{}`` equivalent to the label (sympy, with a time limit) |
| ``deepscaler`` | 1/0: as ``math``, on the text after ``</think>`` (no ``</think>``: 0) |
| ``dapo`` | dict ``{"score": 1/-1, "acc", "pred"}`` from ``Answer: ...``; train with ``--reward-key score`` |
| ``f1`` | token F1 against the label |
| ``gpqa`` | 1/0: the chosen letter of a multiple-choice question (choices in the metadata) |
| ``remote_rm`` | what the service at ``--rm-url`` answers (``--rm-timeout``, ``--rm-max-retries``) |
| ``random`` | 0 or 1 at random |
| a built-in task's name | that task's own rule (``compare``, ``arithmetic``, ...) |

``boxed_<type>`` reduces the response to the content of its last ``\\boxed{}`` (empty without one) and
scores that with ``<type>``, as slime does; not for ``math``/``deepscaler``/``dapo``, which read their
answer from the whole response (slime then scores every sample 0 or -1; here it is an error).
Rule-based rewards run in a worker thread, so a slow sympy check never stalls the rollout's event loop.

Several rewards (TRL's ``reward_funcs`` + ``reward_weights``): this plugin declares ``--reward-weights`` and logs
each combined reward as ``rollout/reward/<name>``; the rollout combines them (``slimecore.rollout.rewards``:
``sum_i w_i * r_i`` over the built-in reward, when ``--rm-type`` is given with ``--reward-weights``, then each
reward plugin in ``--plugin`` order).

``slime_group_reward`` (``--group-rm``) scores every sample of a group this way, concurrently (slime's
``batched_async_rm`` without a custom RM); a plugin that scores whole groups replaces it. A reward model
or judge of your own is a plugin too: its ``slime_reward`` replaces this one.
"""

from __future__ import annotations

import asyncio
import difflib
import random

import math

from slimecore import hookimpl
from slimecore.config import ConfigError, Option
from slimecore.data.tasks import TASKS
from slimecore.rewards.dapo import dapo_reward
from slimecore.rewards.deepscaler import deepscaler_reward
from slimecore.rewards.f1 import f1_reward
from slimecore.rewards.gpqa import gpqa_reward
from slimecore.rewards.math import last_boxed, math_reward
from slimecore.rewards.remote import close_sessions, remote_reward
from slimecore.rollout.rewards import (REWARDS_KEY, check_reward_sources, combined_reward,  # noqa: F401 (moved there)
                                       reward_sources, reward_weights)


def _task_reward(task):
    return lambda response, label, metadata: task.reward(response, label)


# type -> fn(response, label, metadata) -> float | dict
REWARDS = {name: _task_reward(task) for name, task in TASKS.items()}
REWARDS.update(math=math_reward, deepscaler=deepscaler_reward, dapo=dapo_reward, f1=f1_reward, gpqa=gpqa_reward,
               random=lambda response, label, metadata: float(random.randint(0, 1)))
REMOTE = "remote_rm"
READS_WHOLE_RESPONSE = ("math", "deepscaler", "dapo")
PLUGIN_HINT = "or write a plugin with an async slime_reward(config, sample) hookimpl and pass --plugin ./my_reward.py"


def known_types() -> list[str]:
    return sorted([*REWARDS, REMOTE])


def parse_type(rm_type: str, source: str) -> tuple[bool, str]:
    """``(boxed, base type)`` of an rm_type; ``source`` says where it came from, for the error."""
    rm_type = rm_type.strip()
    boxed = rm_type.startswith("boxed_")
    base = rm_type.removeprefix("boxed_")
    if base not in REWARDS and base != REMOTE:
        hint = difflib.get_close_matches(base, known_types(), n=1)
        raise ValueError(f"no built-in reward {rm_type!r} ({source})" + (f"; did you mean {hint[0]!r}?" if hint else "")
                         + f" Known: {', '.join(known_types())}, each also as boxed_<type>. Choose one of those, "
                         + PLUGIN_HINT)
    if boxed and base in READS_WHOLE_RESPONSE:
        raise ValueError(f"reward {rm_type!r} ({source}) cannot work: {base} reads its answer from the whole "
                         f"response, which boxed_ has already cut down to the boxed content; use {base!r}")
    return boxed, base


NAME = "slimecore.defaults.reward"  # slimecore.rollout.rewards.BUILTIN: its --reward-weights are read there


@hookimpl
def slime_options():
    return [Option("reward_weights", float, None, "One weight per reward when several are combined: the built-in "
                   "--rm-type reward (when --rm-type is given), then each reward plugin in --plugin order. Default: "
                   "1 each. The sample's reward is the weighted sum.", nargs="+")]


@hookimpl
def slime_log_rollout(config, samples, metrics):
    """``rollout/reward/<name>``: the mean of each combined reward over the samples it scored."""
    per_source: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in (sample.metadata.get(REWARDS_KEY) or {}).items():
            per_source.setdefault(name, []).append(value)
    for name, values in per_source.items():
        metrics[f"rollout/reward/{name}"] = math.fsum(values) / len(values)


@hookimpl
def slime_validate_config(config):
    if config.rm_max_retries < 1:
        raise ConfigError(f"--rm-max-retries must be at least 1 (attempts per remote_rm request), got "
                          f"{config.rm_max_retries}")
    if config.rm_timeout <= 0 or config.rm_retry_delay < 0:
        raise ConfigError(f"--rm-timeout must be > 0 and --rm-retry-delay >= 0 (seconds), got {config.rm_timeout} "
                          f"and {config.rm_retry_delay}")
    if not config.rm_type:
        return
    try:
        _, base = parse_type(config.rm_type, "--rm-type")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if base == REMOTE and not config.rm_url:
        raise ConfigError("--rm-type remote_rm needs --rm-url, the address of the reward service to POST "
                          "{prompt, response, label} to")
    if base == "dapo" and not config.reward_key:
        raise ConfigError("--rm-type dapo returns a dict {score, acc, pred}; add --reward-key score (or acc) to "
                          "choose what to train on")


async def score(config, sample):
    """One sample's reward by its rm_type (see the module docstring)."""
    if sample.metadata.get("rm_type"):
        rm_type, source = sample.metadata["rm_type"], f"sample {sample.index}'s metadata rm_type"
    elif config.rm_type:
        rm_type, source = config.rm_type, "--rm-type"
    else:
        raise ValueError(f"sample {sample.index} has no reward type: its metadata has no 'rm_type' and --rm-type is "
                         f"not set; set --rm-type to one of {', '.join(known_types())}, {PLUGIN_HINT}")
    boxed, base = parse_type(rm_type, source)
    response = (last_boxed(sample.response or "") or "") if boxed else sample.response
    if base == REMOTE:
        if not config.rm_url:
            raise ValueError(f"{source} is {rm_type!r} but --rm-url is not set; give the reward service's URL")
        return await remote_reward(config.rm_url, sample.prompt, response, sample.label, timeout=config.rm_timeout,
                                   attempts=config.rm_max_retries, retry_delay=config.rm_retry_delay)
    return await asyncio.to_thread(REWARDS[base], response, sample.label, sample.metadata)


@hookimpl
async def slime_reward(config, sample):
    return await score(config, sample)


@hookimpl
async def slime_group_reward(config, samples):
    return list(await asyncio.gather(*(score(config, sample) for sample in samples)))


@hookimpl
def slime_shutdown(config, process):
    if process == "rollout":
        close_sessions()
