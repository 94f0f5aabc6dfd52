"""A sample's reward when several rewards are combined (TRL's ``reward_funcs`` + ``reward_weights``).

When more than one plugin answers ``slime_reward``, or ``--reward-weights`` is given, every answer is taken and
the sample's reward is ``sum_i w_i * r_i`` (each weight 1 unless given), each ``r_i`` kept in
``sample.metadata["rewards"]`` (the built-in reward plugin logs each as ``rollout/reward/<name>``). The sources,
in the order the weights follow: the built-in reward (named after ``--rm-type``) when ``--rm-type`` is given
with ``--reward-weights``, then each reward plugin in ``--plugin`` order (``--custom-rm-path`` first). A source
answering None is left out of that sample's sum, as TRL does with None; a dict answer is reduced with
``--reward-key``. ``--reward-weights`` is the built-in reward plugin's option (``slimecore.defaults.reward``).
"""

from __future__ import annotations

import asyncio
import math

from slimecore.config import ConfigError
from slimecore.errors import HookCallError

BUILTIN = "slimecore.defaults.reward"  # the built-in reward plugin: it declares --reward-weights
REWARDS_KEY = "rewards"  # sample.metadata key: each source's reward, when several are combined


def reward_weights(config) -> list[float] | None:
    return getattr(config.plugin(BUILTIN), "reward_weights", None)  # absent from a Config.make without plugin values


def reward_sources(hooks, config) -> list[tuple[str, object]]:
    """``(name, hookimpl)`` of every reward a sample's reward is made of, in the order ``--reward-weights``
    follows (see the module docstring). One source without weights: the ordinary one-answer reward."""
    impls = hooks.answerers("slime_reward")
    weights = reward_weights(config)
    builtin = next(i for i in hooks.pm.hook.slime_reward.get_hookimpls() if i.plugin.__name__ == BUILTIN)
    if weights and config.rm_type and builtin not in impls:
        impls = [builtin, *impls]
    return [((config.rm_type or "builtin") if i is builtin else _source_name(hooks, i), i) for i in impls]


def _source_name(hooks, impl) -> str:
    named = getattr(impl.function, "slime_reward_name", None)  # the slime adapter names its --custom-rm-path
    return named(hooks.config) if named else hooks.plugin_name(impl)


def check_reward_sources(hooks, config) -> None:
    """Start-up check: ``--reward-weights`` gives exactly one weight per reward, and is not used with --group-rm."""
    weights = reward_weights(config)
    if not weights:
        return
    names = [name for name, _ in reward_sources(hooks, config)]
    if config.group_rm:
        raise ConfigError("--reward-weights combines per-sample rewards; --group-rm scores whole groups with one "
                          "slime_group_reward. Drop one of them")
    if len(weights) != len(names):
        raise ConfigError(f"--reward-weights has {len(weights)} weight(s) but this run has {len(names)} reward(s): "
                          f"{', '.join(names)} (the built-in --rm-type reward counts when --rm-type is given); give "
                          "one weight per reward, in that order")


async def combined_reward(hooks, config, sample) -> float | dict:
    """The sample's reward: the one answering plugin's, or the weighted sum of every source's (module docstring)."""
    sources = reward_sources(hooks, config)
    weights = reward_weights(config)
    if len(sources) == 1 and not weights:
        return await hooks.slime_reward(config=config, sample=sample)
    answers = await asyncio.gather(*(hooks.call("slime_reward", impl, config=config, sample=sample)
                                     for _, impl in sources))
    parts: dict[str, float] = {}
    for (name, _), answer in zip(sources, answers):
        if isinstance(answer, dict):
            if not config.reward_key or config.reward_key not in answer:
                raise HookCallError(name, "slime_reward", ValueError(
                    f"answered a dict with keys {sorted(answer)}; combined rewards need --reward-key naming the one "
                    "to add up"))
            answer = answer[config.reward_key]
        if answer is not None:
            parts[name] = float(answer)
    if not parts:
        raise HookCallError(BUILTIN, "slime_reward", ValueError(f"every reward ({', '.join(n for n, _ in sources)}) "
                                                                "answered None for this sample"))
    sample.metadata[REWARDS_KEY] = parts
    weight_of = dict(zip((name for name, _ in sources), weights or [1.0] * len(sources)))
    return math.fsum(weight_of[name] * value for name, value in parts.items())
