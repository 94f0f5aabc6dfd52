"""A pip-installable reward plugin: `pip install ./examples/my-reward-plugin`, then
`slime-core train --plugin grpo --plugin my_reward --length-penalty 0.01`."""

from slimecore import hookimpl
from slimecore.config import Option


@hookimpl
def slime_options():
    return [Option("length_penalty", float, 0.0, "Reward lost per response character.")]


@hookimpl
async def slime_reward(config, sample):
    correct = sample.label is not None and str(sample.label).strip() in sample.response
    return float(correct) - config.plugin("my_reward").length_penalty * len(sample.response)
