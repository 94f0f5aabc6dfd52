"""An in-house reward as one file: slime-core train --plugin grpo --plugin ./examples/my_reward.py

Rewards short answers that contain the label; replaces the built-in rule-based reward.
"""

from slimecore import hookimpl


@hookimpl
async def slime_reward(config, sample):
    if sample.label is None:
        return 0.0
    hit = str(sample.label).strip() in sample.response
    return 1.0 if hit and len(sample.response) < 40 else 0.0
