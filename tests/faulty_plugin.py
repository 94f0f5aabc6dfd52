"""Test plugin: the faults a plugin or its environment brings into a run, chosen by ``--fault``:
``reward-raises`` (every reward raises), ``reward-hangs`` (no reward ever returns), ``drop-all`` (a group
filter that rejects every group)."""

import asyncio

from slimecore import hookimpl
from slimecore.config import Option
from slimecore.types import FilterResult


def _fault(config) -> str:
    return config.plugin("faulty_plugin").fault


@hookimpl
def slime_options():
    return [Option("fault", str, "none", "Which fault to bring.",
                   choices=("none", "reward-raises", "reward-hangs", "drop-all"))]


@hookimpl
async def slime_reward(config, sample):
    if _fault(config) == "reward-raises":
        raise ValueError(f"the judge cannot parse sample {sample.index}")
    if _fault(config) == "reward-hangs":
        await asyncio.Event().wait()
    return 1.0


@hookimpl
def slime_filter_group(config, samples):
    if _fault(config) == "drop-all":
        return FilterResult(False, reason="never_good_enough")
    return None
