"""GRPO math, as slime computes it (``compute_advantages_and_returns`` with ``--advantage-estimator grpo``, its
reward post-processing and ``policy_loss_function``), with deliberate fixes listed below.

Variant implemented:
- Rewards: per prompt group, ``r - mean(r)``, then divided by ``std(r) + 1e-6`` with the *unbiased*
  std (slime's ``torch.std``) unless ``--disable-grpo-std-normalization`` (Dr.GRPO);
  ``--disable-rewards-normalization`` keeps raw rewards.
- Advantages: ``A_{i,t} = r_i`` on every response token; ``returns = advantages``; optional
  ``--normalize-advantages`` whitens over all unmasked tokens of the step (across DP ranks).
- Loss: slime's PPO-clip policy loss (clip-higher, dual clip, TIS / ICEPOP, entropy bonus, KL loss), the core's
  ``slimecore.ops.policy_loss``, which gspo and ppo use as well; its docstring has the formulas.
- DAPO's soft overlong punishment (``--overlong-buffer-len B``): with ``L_max = --rollout-max-response-len``,
  a response of length ``L > L_max - B`` gets ``+ factor * (L_max - B - L) / B`` added to its reward before
  group normalisation (``--overlong-penalty-factor``, 1.0); the logged raw reward is unchanged.

Fixes relative to slime, on purpose:
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


def group_normalize(rewards: list[float], group_ids: list, std_normalize: bool, eps: float = 1e-6,
                    excluded: list[bool] | None = None, rollout_ids: list | None = None) -> list[float]:
    """Centre (and scale) each sample's reward by its group's statistics. Samples marked in ``excluded`` (FAILED)
    stay out of the statistics and get 0. With ``rollout_ids``, samples of one rollout (an agent episode forked
    into several samples) count once in the mean and std, as the mean of their rewards, so a rollout does not
    weigh more in its group for having forked."""
    import torch  # here: the plugin's module loads in the driver, which needs no torch (``slime_grpo.plugin``)

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


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then linear down to ``-factor``."""
    expected = max_len - buffer
    return min(0.0, factor * (expected - length) / buffer) if length > expected else 0.0


# -- policy-gradient surrogates other than PPO-clip (``--advantage-estimator cispo | reinforce``) ----------------
# Same contract as ``slimecore.ops.ppo_clip.clipped_surrogate``: per-token (R,) tensors in, ``(loss, clipfrac,
# ppo_kl)`` out, so ``slimecore.ops.policy_loss`` applies TIS, entropy and KL loss on top of either unchanged.

def cispo_surrogate(log_probs, old_log_probs, advantages, eps_low: float, eps_high: float, eps_c=None):
    """CISPO (MiniMax-M1): ``L = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp``. The clipped ratio is a
    constant, so every token keeps a gradient ``A * clip(ratio)`` through ``logp``; ``clipfrac = 1[clipped !=
    ratio]``. ``eps_c`` (dual clip) has no meaning here and is ignored, as in slime."""
    import torch

    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    truncated = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -truncated.detach() * advantages * log_probs, (truncated != ratio).float(), ppo_kl


def reinforce_surrogate(log_probs, old_log_probs, advantages, eps_low=None, eps_high=None, eps_c=None):
    """Plain REINFORCE: ``L = -A * logp``; no ratio, no clipping (``clipfrac`` 0). ``ppo_kl`` is still reported."""
    import torch

    return -advantages * log_probs, torch.zeros_like(log_probs), old_log_probs - log_probs


SURROGATES = {"cispo": cispo_surrogate, "reinforce": reinforce_surrogate}  # "grpo": the core's PPO-clip
