"""GRPO math, as slime computes it (reference/slime.md 4.1, 4.3, 4.5), with two deliberate fixes.

Variant implemented:
- Rewards: per prompt group, ``r - mean(r)``, then divided by ``std(r) + 1e-6`` with the *unbiased*
  std (slime's ``torch.std``) unless ``--disable-grpo-std-normalization`` (Dr.GRPO);
  ``--disable-rewards-normalization`` keeps raw rewards.
- Advantages: ``A_{i,t} = r_i`` on every response token; ``returns = advantages``; optional
  ``--normalize-advantages`` whitens over all unmasked tokens of the step (across DP ranks).
- Loss: ``ratio = exp(logp - logp_old)``; ``L = max(-ratio A, -clip(ratio, 1-eps, 1+eps_high) A)``;
  dual clip ``--eps-clip-c c``: where ``A < 0``, ``L = min(L, -c A)``; ``pg_clipfrac = 1[clipped > unclipped]``;
  ``loss = pg_loss - entropy_coef * entropy + kl_loss_coef * KL(logp, logp_ref)``.
- Train/inference mismatch (``--use-tis`` or ``--get-mismatch-metrics``), per token, no gradient through
  the weight: ``rho = exp(logp_old - logp_rollout)``; vanilla TIS ``w = clamp(rho, tis_clip_low, tis_clip)``,
  ICEPOP (``--tis-mode icepop``) ``w = rho`` inside ``[tis_clip_low, tis_clip]`` and 0 outside; with
  ``--use-tis`` the per-token loss becomes ``L * w``. Metrics: ``tis`` (mean w), ``tis_clipfrac``
  (``w != rho``), ``tis_abs`` (``|rho - 1|``), ``ois`` (``exp(-ppo_kl)``).
- DAPO's soft overlong punishment (``--overlong-buffer-len B``): with ``L_max = --rollout-max-response-len``,
  a response of length ``L > L_max - B`` gets ``+ factor * (L_max - B - L) / B`` added to its reward before
  group normalisation (``--overlong-penalty-factor``, 1.0); the logged raw reward is unchanged.

Fixes relative to slime (DESIGN.md section 8):
- Groups come from ``Sample.group_index``, not from reshaping the batch to ``[-1, n_samples_per_prompt]``,
  so fan-out and uneven groups are normalised per prompt instead of as one whole-batch group.
- A group of one sample gets reward ``0`` after centring and no std division (slime: NaN).
- A FAILED sample (its reward hook raised, timed out or gave NaN; it is not trained) is left out of its
  group's mean and std and gets 0, so a failure does not move its siblings' advantages.
- Samples sharing a ``rollout_id`` (an agent episode whose history forked) count once in their group's mean
  and std (as the mean of their rewards); each is centred by those statistics.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from slimecore.ops.kl import approx_kl


def group_normalize(rewards: list[float], group_ids: list, std_normalize: bool, eps: float = 1e-6,
                    excluded: list[bool] | None = None, rollout_ids: list | None = None) -> list[float]:
    """Centre (and scale) each sample's reward by its group's statistics. Samples marked in ``excluded`` (FAILED)
    stay out of the statistics and get 0. With ``rollout_ids``, samples of one rollout (an agent episode forked
    into several samples) count once in the mean and std, as the mean of their rewards, so a rollout does not
    weigh more in its group for having forked."""
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        if not (excluded and excluded[i]):
            groups[g].append(i)
    out = [0.0] * len(rewards)
    for members in groups.values():
        by_rollout: dict = defaultdict(list)
        for i in members:
            rollout = rollout_ids[i] if rollout_ids is not None else None
            by_rollout[("sample", i) if rollout is None else rollout].append(rewards[i])
        r = torch.tensor([sum(v) / len(v) for v in by_rollout.values()], dtype=torch.float64)
        mean, scale = r.mean(), 1.0
        if std_normalize and len(r) > 1:
            scale = r.std(unbiased=True) + eps
        for i in members:
            out[i] = float((rewards[i] - mean) / scale)
    return out


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


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then linear down to ``-factor``."""
    expected = max_len - buffer
    return min(0.0, factor * (expected - length) / buffer) if length > expected else 0.0


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


def policy_loss(opts, batch: dict, outputs: dict, reducer, sequence_ratio: bool = False):
    """Loss and metrics of one micro-batch (see the module docstring); ``sequence_ratio`` gives GSPO."""
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
