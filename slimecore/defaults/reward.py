"""Built-in reward plugin: rule-based rewards chosen by ``sample.metadata["rm_type"]``, then ``--rm-type``.

``REWARDS`` maps a type name to ``fn(response, label) -> float``; the built-in tasks register theirs.
An in-house reward replaces this whole plugin with a ``slime_reward`` hookimpl of its own.
"""

from slimecore import hookimpl
from slimecore.data.tasks import TASKS

REWARDS = {name: task.reward for name, task in TASKS.items()}


@hookimpl
async def slime_reward(config, sample):
    rm_type = sample.metadata.get("rm_type") or config.rm_type
    if rm_type not in REWARDS:
        raise ValueError(f"no built-in reward {rm_type!r} (from sample metadata rm_type or --rm-type); known: "
                         f"{', '.join(sorted(REWARDS))}. Set --rm-type, or add a plugin with a slime_reward hook "
                         "(--plugin ./my_reward.py; see docs/plugins.md)")
    return REWARDS[rm_type](sample.response, sample.label)
