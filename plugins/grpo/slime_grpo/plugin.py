"""slime-core hooks for GRPO. The math is in ``slime_grpo.algorithm``.

The tensor maths (torch, ``slimecore.ops``) is imported in the hooks that use it: the driver only reads the
options and validates them, and starts without torch (1.2 s of a 2-core machine before Ray)."""

from __future__ import annotations

from slimecore import hookimpl
from slimecore.config import ConfigError, Option
from slimecore.ops.kl import KL_TYPES
from slimecore.types import Status
from slime_grpo.algorithm import SURROGATES, group_normalize, overlong_penalty

NAME = "grpo"


@hookimpl
def slime_options():
    return [*policy_options(),
            Option("advantage_estimator", str, "grpo", "grpo: PPO-clip surrogate; cispo: -sg(clip(ratio)) * A * logp "
                   "(MiniMax-M1); reinforce: -A * logp, no ratio. All three use GRPO's group-normalised rewards.",
                   choices=("grpo", *SURROGATES))]


def policy_options():
    """The options of slime's policy loss and reward shaping, which gspo and ppo declare as well."""
    return [
        Option("eps_clip", float, 0.2, "Lower clip range of the ratio."),
        Option("eps_clip_high", float, None, "Upper clip range (default: --eps-clip); DAPO clip-higher."),
        Option("eps_clip_c", float, None, "Dual-clip constant (> 1) for negative advantages."),
        Option("use_kl_loss", bool, False, "Add a KL(policy || reference) loss term."),
        Option("kl_loss_coef", float, 0.0, "Coefficient of the KL loss."),
        Option("kl_loss_type", str, "k1", "KL estimator.", choices=KL_TYPES),
        Option("kl_coef", float, 0.0, "KL-in-reward coefficient (not used by GRPO advantages; see README)."),
        Option("entropy_coef", float, 0.0, "Entropy bonus coefficient."),
        Option("disable_grpo_std_normalization", bool, False, "Dr.GRPO: centre rewards without dividing by std."),
        Option("disable_rewards_normalization", bool, False, "Train on raw rewards."),
        Option("normalize_advantages", bool, False, "Whiten advantages over the step's tokens."),
        Option("use_rollout_logprobs", bool, False, "Use the engine's log-probs as the old policy."),
        Option("use_tis", bool, False, "Weight the per-token loss by the train/rollout importance ratio (TIS)."),
        Option("tis_mode", str, "tis", "tis: clamp the old/rollout ratio to [--tis-clip-low, --tis-clip]; icepop: "
               "zero it outside; current: clamp the current/rollout ratio (slime #2084's off_policy_is_function).",
               choices=("tis", "icepop", "current")),
        Option("tis_clip", float, 2.0, "Upper bound of the TIS / ICEPOP ratio."),
        Option("tis_clip_low", float, 0.0, "Lower bound of the TIS / ICEPOP ratio."),
        Option("get_mismatch_metrics", bool, False, "Log tis, tis_clipfrac, tis_abs, ois without correcting."),
        Option("overlong_buffer_len", int, None, "DAPO soft overlong punishment over the last N tokens of "
               "--rollout-max-response-len."),
        Option("overlong_penalty_factor", float, 1.0, "Largest overlong penalty (at the length limit)."),
    ]


@hookimpl
def slime_validate_config(config):
    validate(config.plugin(NAME))
    validate_lengths(config, config.plugin(NAME))


def validate_lengths(config, o) -> None:
    if o.overlong_buffer_len is not None and o.overlong_buffer_len >= config.rollout_max_response_len:
        raise ConfigError(f"--overlong-buffer-len {o.overlong_buffer_len} must be smaller than "
                          f"--rollout-max-response-len {config.rollout_max_response_len}")


def validate(o, kl_in_reward: bool = False) -> None:
    """Checks shared by every plugin built on these options (grpo, gspo, ppo). ``kl_in_reward``: the
    plugin's advantages use ``--kl-coef`` (the PPO family), so it is allowed."""
    if o.kl_coef and o.kl_loss_coef:
        raise ConfigError("--kl-coef and --kl-loss-coef are mutually exclusive: KL goes either into the reward or "
                          "into the loss; set one of them to 0")
    if o.kl_coef and not kl_in_reward:
        raise ConfigError("--kl-coef (KL in reward) has no effect on GRPO advantages (slime ignores it silently); "
                          "use --use-kl-loss --kl-loss-coef instead")
    if o.eps_clip_c is not None and o.eps_clip_c <= 1:
        raise ConfigError(f"--eps-clip-c must be > 1 (got {o.eps_clip_c})")
    if o.kl_loss_coef and not o.use_kl_loss:
        raise ConfigError("--kl-loss-coef is set but --use-kl-loss is not; add --use-kl-loss")
    if o.use_tis and o.use_rollout_logprobs and o.tis_mode != "current":
        raise ConfigError("--use-tis and --use-rollout-logprobs are mutually exclusive: TIS corrects the recomputed "
                          "old policy towards the engine's; with the engine's log-probs as the old policy there is "
                          "nothing to correct. Drop one of them, or weight by the current policy (--tis-mode "
                          "current)")
    if not 0 <= o.tis_clip_low < o.tis_clip:
        raise ConfigError(f"need 0 <= --tis-clip-low < --tis-clip (got {o.tis_clip_low}, {o.tis_clip})")
    if o.overlong_buffer_len is not None and o.overlong_buffer_len <= 0:
        raise ConfigError(f"--overlong-buffer-len must be > 0 (got {o.overlong_buffer_len})")


@hookimpl
def slime_post_process_rewards(config, samples):
    return post_process_rewards(config, config.plugin(NAME), samples)


def post_process_rewards(config, o, samples):
    raw = [s.get_reward_value(config.reward_key) for s in samples]
    shaped = shape_rewards(config, o, samples, raw)
    if o.disable_rewards_normalization:
        return raw, shaped
    groups = [s.group_index if s.group_index is not None else i // config.n_samples_per_prompt
              for i, s in enumerate(samples)]
    std = not o.disable_grpo_std_normalization and config.n_samples_per_prompt > 1
    return raw, group_normalize(shaped, groups, std, excluded=[s.status == Status.FAILED for s in samples],
                                rollout_ids=[s.rollout_id for s in samples])


def shape_rewards(config, o, samples, raw: list[float]) -> list[float]:
    """Raw rewards plus DAPO's overlong penalty (when ``--overlong-buffer-len`` is set)."""
    if not o.overlong_buffer_len:
        return list(raw)
    return [r + overlong_penalty(s.response_length, config.rollout_max_response_len, o.overlong_buffer_len,
                                 o.overlong_penalty_factor) for r, s in zip(raw, samples)]


@hookimpl
def slime_train_inputs(config, role):
    return train_inputs(config, config.plugin(NAME))


def train_inputs(config, o):
    """The old policy is recomputed only when a rollout feeds several optimizer steps; with one step the
    model *is* the old policy and the loss uses its detached log-probs (slime's reuse path)."""
    samples = config.rollout_batch_size * config.n_samples_per_prompt
    needs = []  # the loss gets the current policy's entropy in ``outputs``; no separate pass
    if config.global_batch_size < samples and not o.use_rollout_logprobs:
        needs.append("log_probs")
    if o.use_kl_loss:
        needs.append("ref_log_probs")
    return needs


@hookimpl
def slime_compute_advantages(config, role, batch):
    return compute_advantages(config.plugin(NAME), batch)


def compute_advantages(o, batch):
    import torch

    from slimecore.ops.masked import masked_whiten

    advantages = [torch.full((n,), float(r)) for r, n in zip(batch["rewards"], batch["response_lengths"])]
    if o.normalize_advantages and advantages:
        masks = torch.cat(batch["loss_masks"])
        flat = masked_whiten(torch.cat(advantages), masks, distributed=True)
        advantages = list(torch.split(flat, list(batch["response_lengths"])))
    return {"advantages": advantages, "returns": advantages}


@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    from slimecore.ops.ppo_clip import clipped_surrogate, policy_loss

    o = config.plugin(NAME)
    return policy_loss(o, batch, outputs, reducer, surrogate=SURROGATES.get(o.advantage_estimator, clipped_surrogate))
