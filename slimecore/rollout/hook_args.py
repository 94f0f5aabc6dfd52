"""What the rollout-side hooks get instead of the plugin facade: each only what it calls.

- ``slime_data_source`` gets ``buffer_filter(buffer, num_groups)`` (``buffer_filter``): the run's
  ``slime_buffer_filter`` (the built-in default takes the oldest groups).
- ``slime_rollout`` gets ``sample_hooks`` (``SampleHooks``): the per-sample and per-group hooks, bound to the
  run's plugins, in the order the built-in rollout calls them.
- ``slime_generate`` gets ``observation`` and ``agent``: the ``slime_observation`` / ``slime_agent`` hooks as
  async callables with those hooks' keyword arguments, or None when no active plugin implements them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slimecore.protocols import AgentHook, BufferFilter, ObservationHook  # noqa: F401 (the contract's; named here)
from slimecore.rollout.rewards import combined_reward
from slimecore.types import FilterResult, Sample

if TYPE_CHECKING:
    from slimecore.config import Config
    from slimecore.plugins import Hooks
    from slimecore.rollout.client import RolloutClient


def buffer_filter(hooks: Hooks, config: Config) -> BufferFilter:
    """``slime_buffer_filter`` as a data source calls it (the built-in default answers last: the oldest groups)."""
    def choose(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
        return hooks.slime_buffer_filter(config=config, buffer=buffer, num_groups=num_groups)

    return choose


class SampleHooks:
    """The hooks a rollout calls for each sample and prompt group, bound to the run's plugins: ``generate`` ->
    ``process_sample`` -> ``reward`` (or ``group_reward`` when ``scores_groups``) -> ``filter_group``. Each
    takes the (per eval set, possibly changed) config of the call. What ``slime_rollout`` may use of it is the
    contract's ``slimecore.protocols.SampleHooks``."""

    def __init__(self, hooks: Hooks):
        self._hooks = hooks

    async def generate(self, *, config: Config, sample: Sample, sampling_params: dict, client: RolloutClient,
                       evaluation: bool) -> Sample | list[Sample]:
        """``slime_generate``, given the run's ``slime_observation`` and ``slime_agent`` when a plugin has them."""
        hooks = self._hooks
        return await hooks.slime_generate(
            config=config, sample=sample, sampling_params=sampling_params, client=client, evaluation=evaluation,
            observation=hooks.slime_observation if hooks.implementers("slime_observation") else None,
            agent=hooks.slime_agent if hooks.implementers("slime_agent") else None)

    async def process_sample(self, *, config: Config, sample: Sample, rollout_id: int, evaluation: bool) -> None:
        await self._hooks.slime_process_sample(config=config, sample=sample, rollout_id=rollout_id,
                                               evaluation=evaluation)

    async def reward(self, *, config: Config, sample: Sample) -> float | dict:
        """``slime_reward``: the one answering plugin's, or the weighted sum of several (``--reward-weights``)."""
        return await combined_reward(self._hooks, config, sample)

    def scores_groups(self, config: Config, evaluation: bool) -> bool:
        """Whether ``--group-rm`` scores whole groups: not in eval, and not where a plugin's own per-sample reward
        would be bypassed by the built-in group scorer, which only knows the built-in reward types."""
        if not config.group_rm or evaluation:
            return False
        hooks = self._hooks
        group, single = hooks.answerer("slime_group_reward"), hooks.answerer("slime_reward")
        return not (hooks.is_default(group) and not hooks.is_default(single))

    async def group_reward(self, *, config: Config, samples: list[Sample]) -> list[float | dict]:
        return await self._hooks.slime_group_reward(config=config, samples=samples)

    def filter_group(self, *, config: Config, samples: list[Sample]) -> tuple[FilterResult, str | None]:
        """The first rejecting verdict of the group filters, with the plugin that gave it (None: all keep)."""
        for plugin, answer in self._hooks.slime_filter_group(config=config, samples=samples):
            result = answer if isinstance(answer, FilterResult) else FilterResult(bool(answer))
            if not result.keep:
                return result, plugin
        return FilterResult(True), None

    def answering(self, hook: str) -> str:
        """The plugin that answers the one-answer ``hook`` (for messages, e.g. a timeout naming it)."""
        return self._hooks.plugin_name(self._hooks.answerer(hook))
