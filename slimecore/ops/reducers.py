"""Loss reducers with exact aggregation under packing (slime 4.9).

A reducer maps a micro-batch's per-sample token tensors to that micro-batch's *share* of the step
objective, so the shares add up (over micro-batches and data-parallel ranks) to:
- sample mean: ``J = (1/B) sum_i sum_t x m / max(D_i, 1)`` with ``D_i`` the mask tokens of sample i's
  rollout (``rollout_mask_sums``) and ``B`` the number of rollouts in the optimizer step;
- token mean (``--calculate-per-token-loss``): ``J = sum x m / N`` with ``N`` the step's mask tokens.
A fully masked sample still counts in ``B`` (as in slime).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Reducer = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def make_sample_mean_reducer(loss_masks: Sequence[torch.Tensor], rollout_mask_sums: Sequence[float],
                             num_rollouts_step: int) -> Reducer:
    def reduce(values: Sequence[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for x, m, d in zip(values, loss_masks, rollout_mask_sums, strict=True):
            total = total + (x.float() * m).sum() / max(float(d), 1.0)
        return total / num_rollouts_step

    return reduce


def make_token_mean_reducer(loss_masks: Sequence[torch.Tensor], num_tokens_step: int) -> Reducer:
    def reduce(values: Sequence[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for x, m in zip(values, loss_masks, strict=True):
            total = total + (x.float() * m).sum()
        return total / max(num_tokens_step, 1)

    return reduce
