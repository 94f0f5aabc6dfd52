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
  ``icepop``: ``w = rho`` inside ``[tis_clip_low, tis_clip]`` and 0 outside; with ``use_tis`` ``L`` becomes
  ``L * w``. Metrics ``tis`` (mean w), ``tis_clipfrac`` (``w != rho``), ``tis_abs`` (``|rho - 1|``), ``ois``
  (``exp(-ppo_kl)``);
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


def policy_loss(opts: Any, batch: dict, outputs: dict, reducer, sequence_ratio: bool = False):
    """Loss and metrics of one micro-batch (see the module docstring); ``sequence_ratio`` gives GSPO.

    ``opts`` carries slime's policy-loss options by their slime names: ``eps_clip``, ``eps_clip_high``,
    ``eps_clip_c``, ``use_rollout_logprobs``, ``use_tis``, ``tis_mode``, ``tis_clip``, ``tis_clip_low``,
    ``get_mismatch_metrics``, ``entropy_coef``, ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type`` (the grpo
    plugin declares them; a plugin reusing its options passes its own ``config.plugin(NAME)``)."""
    log_probs = outputs["log_probs"]
    if opts.use_rollout_logprobs:
        old = [lp.to(log_probs[0].device) for lp in batch["rollout_log_probs"]]
    elif "log_probs" in batch:
        old = [lp.to(log_probs[0].device) for lp in batch["log_probs"]]
    else:
        old = [lp.detach() for lp in log_probs]
    eps_high = opts.eps_clip_high if opts.eps_clip_high is not None else opts.eps_clip
    ratio_inputs = log_probs
    if sequence_ratio:
        ratio_inputs = [sequence_level(lp, o, m.to(lp.device)) for lp, o, m in zip(log_probs, old, batch["loss_masks"])]
    per_sample = [clipped_surrogate(lp, o, a.to(lp.device), opts.eps_clip, eps_high, opts.eps_clip_c)
                  for lp, o, a in zip(ratio_inputs, old, batch["advantages"])]
    token_losses = [p[0] for p in per_sample]
    metrics = {}
    if opts.use_tis or opts.get_mismatch_metrics:
        pairs = [importance_weights(o, r.to(o.device), opts.tis_clip_low, opts.tis_clip, opts.tis_mode)
                 for o, r in zip(old, batch["rollout_log_probs"])]
        metrics.update(tis=reducer([w for w, _ in pairs]), tis_clipfrac=reducer([(w != r).float() for w, r in pairs]),
                       tis_abs=reducer([(r - 1).abs() for _, r in pairs]),
                       ois=reducer([torch.exp(-p[2]).detach() for p in per_sample]))
        if opts.use_tis:
            token_losses = [loss * w for loss, (w, _) in zip(token_losses, pairs)]
    pg_loss = reducer(token_losses)
    metrics.update(pg_loss=pg_loss, pg_clipfrac=reducer([p[1] for p in per_sample]),
                   ppo_kl=reducer([p[2] for p in per_sample]))
    loss = pg_loss
    if outputs.get("entropy"):
        entropy_loss = reducer(outputs["entropy"])
        metrics["entropy_loss"] = entropy_loss
        if opts.entropy_coef:
            loss = loss - opts.entropy_coef * entropy_loss
    if opts.use_kl_loss:
        kl = [approx_kl(lp, ref.to(lp.device), opts.kl_loss_type) for lp, ref in zip(log_probs, batch["ref_log_probs"])]
        kl_loss = reducer(kl)
        metrics["kl_loss"] = kl_loss
        loss = loss + opts.kl_loss_coef * kl_loss
    return loss, {key: value.detach() for key, value in metrics.items()}
