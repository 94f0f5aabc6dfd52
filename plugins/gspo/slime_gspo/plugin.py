"""slime-core hooks for GSPO (slime's ``--advantage-estimator gspo``).

The loss is the core's PPO-clip policy loss (``slimecore.ops.policy_loss``) with a sequence-level ratio: for
sample i, ``s_i = sum_t (logp_old - logp) m / max(sum_t m, 1)`` is broadcast to every token as ``ppo_kl`` and
the ratio is ``exp(-s_i)``, the geometric mean of the token ratios over the trainable tokens.

Everything else is GRPO's, imported from ``slime_grpo`` (not copied): the options, their validation, group
reward normalisation, advantages and the train inputs. The hooks below delegate to those functions with
this plugin's own option namespace, ``config.plugin("gspo")``, so ``--plugin gspo`` works on its own.
"""

from __future__ import annotations

from slime_grpo import plugin as grpo
from slimecore import hookimpl
from slimecore.ops.ppo_clip import policy_loss

NAME = "gspo"


@hookimpl
def slime_options():
    return grpo.policy_options()


@hookimpl
def slime_validate_config(config):
    grpo.validate(config.plugin(NAME))
    grpo.validate_lengths(config, config.plugin(NAME))


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
