"""slime-core hooks for the PPO family: PPO with a critic (GAE), REINFORCE++ and REINFORCE++-baseline.

Variant implemented (slime's ``compute_advantages_and_returns``, ``policy_loss_function`` and
``value_loss_function``; the estimators are in ``slime_ppo.algorithm``):
- ``--advantage-estimator ppo``: the plugin declares a ``critic`` role (``slime_train_roles``: a value model
  fed the actor's outputs, with ``--critic-lr``, ``--critic-lr-warmup-iters``, ``--critic-hf-checkpoint``) and
  feeds the actor the critic's scores: the critic's values (before its update) reach the actor's batch, the
  actor computes GAE advantages and returns, and the critic trains on those returns with the clipped value
  loss (``--value-clip``). ``--num-critic-only-steps N``: the actor does not update for the first N rollouts.
- ``reinforce_plus_plus``: token-level discounted returns with the KL penalty in the reward.
- ``reinforce_plus_plus_baseline``: group-mean-centred reward (no std division) minus the KL penalty.
- KL in reward (``--kl-coef``): ``kl_t = approx_kl(logp_old, logp_ref, --kl-loss-type)`` where ``logp_old`` is
  the recomputed old policy (the engine's with ``--use-rollout-logprobs``), as slime.
- ``--normalize-advantages`` whitens the advantages over the step's trainable tokens on every DP rank;
  returns are not whitened. Both REINFORCE++ variants require it (slime asserts).
- The actor loss is the core's PPO-clip policy loss (``slimecore.ops.policy_loss``: clip-higher, dual clip,
  TIS, entropy, KL loss) with GRPO's options, imported from ``slime_grpo`` (a declared dependency), not copied.

Departure from slime, on purpose: slime's critic computes its own returns with ``kl = 0`` (it has no
log-probs), so its targets omit the KL penalty the actor's advantages include. Here the critic trains on
the actor's returns, KL included, so both use one definition of the return.
"""

from __future__ import annotations

import torch

from slime_grpo import plugin as grpo
from slime_grpo.algorithm import group_normalize
from slime_ppo.algorithm import gae, reinforce_plus_plus_baseline, reinforce_plus_plus_returns, value_loss
from slimecore import hookimpl
from slimecore.config import ConfigError, Option
from slimecore.ops.kl import approx_kl
from slimecore.ops.masked import masked_whiten
from slimecore.ops.ppo_clip import policy_loss
from slimecore.trainers.roles import Feed, TrainRole
from slimecore.types import Status

NAME = "ppo"
ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@hookimpl
def slime_options():
    return [*grpo.policy_options(),
            Option("advantage_estimator", str, "ppo", "ppo: critic + GAE; reinforce_plus_plus: discounted returns; "
                   "reinforce_plus_plus_baseline: group-centred reward minus KL.", choices=ESTIMATORS),
            Option("gamma", float, 1.0, "Discount factor of GAE and REINFORCE++ returns."),
            Option("lambd", float, 1.0, "GAE lambda."),
            Option("value_clip", float, 0.2, "Clip range of the value loss around the old values."),
            # the critic (--advantage-estimator ppo); slime's flag names
            Option("critic_hf_checkpoint", str, None, "Checkpoint the critic starts from (default: --hf-checkpoint); "
                   "a scalar value head is added on top."),
            Option("critic_lr", float, None, "Critic learning rate (default: --lr)."),
            Option("critic_lr_warmup_iters", int, None, "Critic warm-up optimizer steps (default: --lr-warmup-iters)."),
            Option("num_critic_only_steps", int, 0, "First N rollouts train only the critic; the actor starts after.")]


@hookimpl
def slime_validate_config(config):
    o = config.plugin(NAME)
    grpo.validate(o, kl_in_reward=True)
    grpo.validate_lengths(config, o)
    if o.advantage_estimator.startswith("reinforce_plus_plus") and not o.normalize_advantages:
        raise ConfigError(f"--advantage-estimator {o.advantage_estimator} needs --normalize-advantages "
                          "(slime asserts it for both REINFORCE++ variants); add --normalize-advantages")
    if o.value_clip <= 0:
        raise ConfigError(f"--value-clip must be > 0 (got {o.value_clip})")
    if o.num_critic_only_steps and o.advantage_estimator != "ppo":
        raise ConfigError(f"--num-critic-only-steps {o.num_critic_only_steps} needs a critic, which only "
                          f"--advantage-estimator ppo has (got {o.advantage_estimator}); drop the flag")


@hookimpl
def slime_train_roles(config):
    """PPO's critic: a value model that scores each batch for the actor's GAE, then trains on the actor's returns."""
    o = config.plugin(NAME)
    if o.advantage_estimator != "ppo":
        return []
    critic = TrainRole("critic", model="value", feeds=[Feed("actor", "outputs")],
                       options={"hf_checkpoint": o.critic_hf_checkpoint, "lr": o.critic_lr,
                                "lr_warmup_iters": o.critic_lr_warmup_iters})
    actor = TrainRole("actor", feeds=[Feed("critic", "scores")], update_from=o.num_critic_only_steps)
    return [actor, critic]


@hookimpl
def slime_post_process_rewards(config, samples):
    o = config.plugin(NAME)
    raw = [s.get_reward_value(config.reward_key) for s in samples]
    shaped = grpo.shape_rewards(config, o, samples, raw)  # DAPO's overlong penalty, if asked for
    if o.advantage_estimator != "reinforce_plus_plus_baseline" or o.disable_rewards_normalization:
        return raw, shaped
    groups = [s.group_index if s.group_index is not None else i // config.n_samples_per_prompt
              for i, s in enumerate(samples)]
    return raw, group_normalize(shaped, groups, std_normalize=False,
                                excluded=[s.status == Status.FAILED for s in samples])


@hookimpl
def slime_train_inputs(config, role):
    if role != "actor":
        return []  # the critic computes its own old values
    o = config.plugin(NAME)
    needs = set(grpo.train_inputs(config, o))
    if o.kl_coef:
        needs |= {"ref_log_probs"} | (set() if o.use_rollout_logprobs else {"log_probs"})
    if o.advantage_estimator == "ppo":
        needs.add("values")
    return sorted(needs)


@hookimpl
def slime_compute_advantages(config, role, batch):
    return compute_advantages(config.plugin(NAME), batch)


def compute_advantages(o, batch: dict) -> dict:
    """Per-sample ``advantages`` and ``returns`` ``(R_i,)`` for the chosen estimator (module docstring)."""
    lengths = list(batch["response_lengths"])
    if o.kl_coef:
        old = batch["rollout_log_probs"] if o.use_rollout_logprobs else batch["log_probs"]
        kl = [approx_kl(lp, ref, o.kl_loss_type) for lp, ref in zip(old, batch["ref_log_probs"])]
    else:
        kl = [torch.zeros(n) for n in lengths]
    rewards = [float(r) for r in batch["rewards"]]
    if o.advantage_estimator == "ppo":
        pairs = [gae(r, v, k, o.kl_coef, o.gamma, o.lambd) for r, v, k in zip(rewards, batch["values"], kl)]
        advantages, returns = [p[0] for p in pairs], [p[1] for p in pairs]
    elif o.advantage_estimator == "reinforce_plus_plus":
        returns = [reinforce_plus_plus_returns(r, k, m, o.kl_coef, o.gamma)
                   for r, k, m in zip(rewards, kl, batch["loss_masks"])]
        advantages = list(returns)
    else:
        returns = [reinforce_plus_plus_baseline(r, k, o.kl_coef) for r, k in zip(rewards, kl)]
        advantages = list(returns)
    if o.normalize_advantages and advantages:
        flat = masked_whiten(torch.cat(advantages), torch.cat(batch["loss_masks"]), distributed=True)
        advantages = list(torch.split(flat, lengths))
    return {"advantages": advantages, "returns": returns}


@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    o = config.plugin(NAME)
    if role == "critic":
        return critic_loss(o, batch, outputs, reducer)
    return policy_loss(o, batch, outputs, reducer)


def critic_loss(o, batch: dict, outputs: dict, reducer):
    """slime's ``value_loss_function``: clipped value loss reduced like the policy loss."""
    values = outputs["values"]
    per_sample = [value_loss(v, old.to(v.device), ret.to(v.device), o.value_clip)
                  for v, old, ret in zip(values, batch["values"], batch["returns"])]
    loss = reducer([p[0] for p in per_sample])
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reducer([p[1] for p in per_sample]).detach()}
