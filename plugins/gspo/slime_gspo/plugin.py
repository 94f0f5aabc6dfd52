"""GSPO (slime reference 4.5, step 2): the ratio of sample i is ``exp(-s_i)`` with
``s_i = sum_t (logp_old - logp) m / max(sum_t m, 1)`` (the geometric mean of the token ratios),
clipped with the same ``--eps-clip`` / ``--eps-clip-high`` as GRPO. Rewards, advantages and every
option are GRPO's (imported from ``slime_grpo``, not copied); ``--plugin gspo`` is used on its own.

Departure from the paper: the clip range defaults to GRPO's 0.2, as slime does; the paper uses much
smaller ranges (about 3e-4 / 4e-4), so set ``--eps-clip`` and ``--eps-clip-high`` for paper settings.
"""

from slime_grpo import plugin as grpo
from slime_grpo.algorithm import policy_loss
from slimecore import hookimpl

NAME = "gspo"


@hookimpl
def slime_options():
    return grpo.slime_options()


@hookimpl
def slime_validate_config(config):
    grpo.validate(config.plugin(NAME))


@hookimpl
def slime_post_process_rewards(config, samples):
    return grpo.post_process_rewards(config, config.plugin(NAME), samples)


@hookimpl
def slime_train_inputs(config, role):
    return grpo.train_inputs(config, config.plugin(NAME))


@hookimpl
def slime_compute_advantages(config, role, batch):
    return grpo.compute_advantages(config.plugin(NAME), batch)


@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    return policy_loss(config.plugin(NAME), batch, outputs, reducer, sequence_ratio=True)
