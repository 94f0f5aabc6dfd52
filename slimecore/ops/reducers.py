"""Loss reducers that aggregate exactly under any micro-batching and DP split (slime's ``sum_of_sample_mean``
and its per-token loss).

A reducer maps one micro-batch's per-sample token tensors ``x_i`` (each ``(response_length,)``) to that
micro-batch's *share* of the optimizer step's objective. Shares add up, over the step's micro-batches and
DP ranks, to:
- sample mean (slime's ``sum_of_sample_mean``, the default):
  ``J = (1/B) sum_i sum_t x_it m_it / max(D_i, 1)``, where ``D_i`` (``rollout_mask_sums``) is the number of
  mask tokens of sample i's whole rollout and ``B`` the number of rollouts in the step over all ranks;
  with one sample per rollout this is the mean over samples of each sample's token mean;
- token mean (``--calculate-per-token-loss``): ``J = sum x m / max(N, 1)`` with ``N`` the step's mask tokens
  over all ranks.
So summing the reduced loss's gradients over micro-batches and ranks (never averaging) gives the exact
gradient of ``J``. ``B`` and ``N`` come from the schedule (``slimecore.rollout.schedule``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from slimecore.protocols import Reducer  # the contract's; importable from here


def _check(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> None:
    if len(values) != len(masks):
        raise ValueError(f"reducer got {len(values)} per-sample tensors for a micro-batch of {len(masks)} samples")
    for i, (x, m) in enumerate(zip(values, masks)):
        if x.shape != m.shape:
            raise ValueError(f"reducer: sample {i} has values of shape {tuple(x.shape)} but loss mask of shape "
                             f"{tuple(m.shape)}; per-token values must cover the response tokens exactly")


def _flat_reducer(loss_masks: Sequence[torch.Tensor], token_weights: torch.Tensor) -> Reducer:
    """``x -> sum over the micro-batch's tokens of x * token_weights``: the per-sample tensors are joined
    once, so a reduction is three tensor operations (and as many autograd nodes) whatever the sample count."""

    def reduce(values: Sequence[torch.Tensor]) -> torch.Tensor:
        _check(values, loss_masks)
        if not values:
            return torch.zeros((), dtype=torch.float32)
        return (torch.cat(list(values)).float() * token_weights).sum()

    return reduce


def make_sample_mean_reducer(loss_masks: Sequence[torch.Tensor], rollout_mask_sums: Sequence[float],
                             num_rollouts_step: int) -> Reducer:
    """``x -> sum_i sum_t x m / max(D_i, 1) / B`` over this micro-batch's samples (a scalar, fp32)."""
    if len(loss_masks) != len(rollout_mask_sums):
        raise ValueError(f"{len(loss_masks)} loss masks but {len(rollout_mask_sums)} rollout_mask_sums")
    weights = [1.0 / (max(float(d), 1.0) * max(num_rollouts_step, 1)) for d in rollout_mask_sums]
    token_weights = (torch.cat([m.float() * w for m, w in zip(loss_masks, weights)]) if loss_masks
                     else torch.zeros(0))
    return _flat_reducer(loss_masks, token_weights)


def make_token_mean_reducer(loss_masks: Sequence[torch.Tensor], num_tokens_step: int) -> Reducer:
    """``x -> sum_i sum_t x m / max(N, 1)`` over this micro-batch's samples (a scalar, fp32)."""
    scale = 1.0 / max(int(num_tokens_step), 1)
    token_weights = torch.cat([m.float() for m in loss_masks]) * scale if loss_masks else torch.zeros(0)
    return _flat_reducer(loss_masks, token_weights)
