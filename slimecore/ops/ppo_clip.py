"""PPO-clip policy loss, as slime's ``policy_loss_function`` / ``compute_policy_loss`` compute it, for every
algorithm plugin whose actor loss is a clipped surrogate (grpo, gspo, ppo's actor).

Per micro-batch, on each sample's response tokens (all tensors ``(R,)``):
- old policy ``logp_old``: the engine's log-probs with ``use_rollout_logprobs``, else the recomputed ones
  (``batch["log_probs"]``), else the current ones detached (one optimizer step per rollout: ratio 1);
- ``ppo_kl = logp_old - logp``; with ``sequence_ratio`` (GSPO) every token gets the sample's masked mean
  ``s = sum((logp_old - logp) m) / max(sum m, 1)`` instead, so the ratio is the geometric mean of the token ratios;
- ``ratio = exp(-ppo_kl)``; ``L = max(-ratio A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) A)``;
  dual clip ``eps_clip_c = c``: where ``A < 0``, ``L = min(L, -c A)``; ``pg_clipfrac = 1[clipped > unclipped]``;
- train/inference mismatch (``use_tis`` or ``get_mismatch_metrics``), per token, no gradient through the weight:
  ``rho = exp(logp_old - logp_rollout)``; ``tis_mode`` ``tis``: ``w = clamp(rho, tis_clip_low, tis_clip)``,
  ``icepop``: ``w = rho`` inside ``[tis_clip_low, tis_clip]`` and 0 outside, ``current``: as ``tis`` with the
  current policy in the numerator, ``rho = exp(sg(logp) - logp_rollout)`` (corrects train/inference mismatch and
  staleness in one weight); with ``use_tis`` ``L`` becomes ``L * w``. Metrics ``tis`` (mean w), ``tis_clipfrac``
  (``w != rho``), ``tis_abs`` (``|rho - 1|``), ``ois`` (``exp(-ppo_kl)``);
- ``loss = pg_loss - entropy_coef * entropy + kl_loss_coef * KL(logp, logp_ref)`` (``use_kl_loss``, estimator
  ``kl_loss_type``), every term reduced by the step's reducer.
"""

from __future__ import annotations

from typing import Any

import torch

from slimecore.ops.kl import approx_kl


def clipped_surrogate(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float, eps_c: float | None = None):
    """Per-token PPO-clip loss. All inputs (R,) -> (loss (R,), clipfrac (R,), ppo_kl (R,))."""
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_c * advantages), loss)
    return loss, clipfrac, ppo_kl


def importance_weights(old: torch.Tensor, rollout: torch.Tensor, low: float, high: float, mode: str):
    """Per-token mismatch correction ``(w, rho)``, each (R,), without gradient (see the module docstring)."""
    rho = torch.exp(old.detach().float() - rollout.float())
    if mode == "icepop":
        w = torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))
    else:
        w = rho.clamp(low, high)
    return w, rho


def sequence_level(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: replace per-token log-probs so that ``old - new`` is the sample's masked mean log-ratio
    ``s = sum((old - new) m) / max(sum m, 1)`` on every token; gradients flow through ``s``. (R,) -> (R,)"""
    s = ((old_log_probs - log_probs) * mask).sum() / mask.sum().clamp(min=1)
    return old_log_probs - s.expand_as(log_probs)


def policy_loss(opts: Any, batch: dict, outputs: dict, reducer, sequence_ratio: bool = False,
                surrogate=clipped_surrogate):
    """Loss and metrics of one micro-batch (see the module docstring); ``sequence_ratio`` gives GSPO. ``surrogate``
    replaces the PPO-clip per-token loss by another with ``clipped_surrogate``'s signature (a plugin's).

    ``opts`` carries slime's policy-loss options by their slime names: ``eps_clip``, ``eps_clip_high``,
    ``eps_clip_c``, ``use_rollout_logprobs``, ``use_tis``, ``tis_mode``, ``tis_clip``, ``tis_clip_low``,
    ``get_mismatch_metrics``, ``entropy_coef``, ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type`` (the grpo
    plugin declares them; a plugin reusing its options passes its own ``config.plugin(NAME)``).

    The per-token maths runs once on the micro-batch's tokens joined into one tensor (not once per sample),
    and each term goes to the reducer as per-sample views of it."""
    log_probs = outputs["log_probs"]
    lengths = [len(lp) for lp in log_probs]
    device = log_probs[0].device if log_probs else None

    def joined(tensors) -> torch.Tensor:
        return torch.cat([t.to(device) for t in tensors]) if tensors else torch.zeros(0)

    def per_sample(flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(lengths))

    current = joined(log_probs)
    if opts.use_rollout_logprobs:
        old = joined(batch["rollout_log_probs"])
    elif "log_probs" in batch:
        old = joined(batch["log_probs"])
    else:
        old = current.detach()
    eps_high = opts.eps_clip_high if opts.eps_clip_high is not None else opts.eps_clip
    ratio_input = current
    if sequence_ratio:
        old_each = per_sample(old)
        ratio_input = joined([sequence_level(lp, o, m.to(lp.device))
                              for lp, o, m in zip(log_probs, old_each, batch["loss_masks"])])
    token_loss, clipfrac, ppo_kl = surrogate(ratio_input, old, joined(batch["advantages"]), opts.eps_clip, eps_high,
                                             opts.eps_clip_c)
    metrics = {}
    if opts.use_tis or opts.get_mismatch_metrics:
        numerator = current if opts.tis_mode == "current" else old
        w, rho = importance_weights(numerator, joined(batch["rollout_log_probs"]), opts.tis_clip_low, opts.tis_clip,
                                    opts.tis_mode)
        metrics.update(tis=reducer(per_sample(w)), tis_clipfrac=reducer(per_sample((w != rho).float())),
                       tis_abs=reducer(per_sample((rho - 1).abs())),
                       ois=reducer(per_sample(torch.exp(-ppo_kl).detach())))
        if opts.use_tis:
            token_loss = token_loss * w
    pg_loss = reducer(per_sample(token_loss))
    metrics.update(pg_loss=pg_loss, pg_clipfrac=reducer(per_sample(clipfrac)), ppo_kl=reducer(per_sample(ppo_kl)))
    loss = pg_loss
    if outputs.get("entropy"):
        entropy_loss = reducer(outputs["entropy"])
        metrics["entropy_loss"] = entropy_loss
        if opts.entropy_coef:
            loss = loss - opts.entropy_coef * entropy_loss
    if opts.use_kl_loss:
        kl_loss = reducer(per_sample(approx_kl(current, joined(batch["ref_log_probs"]), opts.kl_loss_type)))
        metrics["kl_loss"] = kl_loss
        loss = loss + opts.kl_loss_coef * kl_loss
    return loss, {key: value.detach() for key, value in metrics.items()}
