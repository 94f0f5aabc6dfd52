"""Test plugin: the faults a plugin or its environment brings into a run, chosen by ``--fault``:
``reward-raises`` (every reward raises), ``reward-hangs`` (no reward ever returns), ``reward-blocks`` (a
``time.sleep`` in the async reward: the event loop stops), ``drop-all`` (a group filter that rejects every
group)."""

import asyncio
import time

from slimecore import hookimpl
from slimecore.config import Option
from slimecore.types import FilterResult


def _fault(config) -> str:
    return config.plugin("faulty_plugin").fault


@hookimpl
def slime_options():
    return [Option("fault", str, "none", "Which fault to bring.",
                   choices=("none", "reward-raises", "reward-hangs", "reward-blocks", "drop-all"))]


@hookimpl
async def slime_reward(config, sample):
    if _fault(config) == "reward-raises":
        raise ValueError(f"the judge cannot parse sample {sample.index}")
    if _fault(config) == "reward-hangs":
        await asyncio.Event().wait()
    if _fault(config) == "reward-blocks":
        time.sleep(3600)  # where an await asyncio.sleep belongs
    return 1.0


@hookimpl
def slime_filter_group(config, samples):
    if _fault(config) == "drop-all":
        return FilterResult(False, reason="never_good_enough")
    return None
