"""Built-in reward plugin: rule-based rewards chosen by ``sample.metadata["rm_type"]``, then ``--rm-type``.

``REWARDS`` maps a type name to ``fn(response, label) -> float``; the built-in tasks register theirs, and
further rule-based types (math, f1, ...) belong here too. Anything else (a reward model, a remote judge)
is a plugin of its own: a ``slime_reward`` hookimpl replaces this one.
"""

from slimecore import hookimpl
from slimecore.data.tasks import TASKS

REWARDS = {name: task.reward for name, task in TASKS.items()}
PLUGIN_HINT = "or write a plugin with an async slime_reward(config, sample) hookimpl and pass --plugin ./my_reward.py"


@hookimpl
async def slime_reward(config, sample):
    rm_type = sample.metadata.get("rm_type") or config.rm_type
    if rm_type is None:
        raise ValueError(f"sample {sample.index} has no reward type: its metadata has no 'rm_type' and --rm-type is "
                         f"not set; set --rm-type to one of {', '.join(sorted(REWARDS))}, {PLUGIN_HINT}")
    if rm_type not in REWARDS:
        raise ValueError(f"no built-in reward {rm_type!r} (from the sample's metadata rm_type or --rm-type); known: "
                         f"{', '.join(sorted(REWARDS))}. Choose one of those, {PLUGIN_HINT}")
    return REWARDS[rm_type](sample.response, sample.label)
