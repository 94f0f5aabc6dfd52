"""Masked statistics and whitening (slime's ``distributed_masked_whiten``), local or over a torch.distributed group.

``masked_whiten`` computes slime's ``distributed_masked_whiten``:
``mean = sum(a m) / N``, ``var = sum((a - mean)^2 m) / (N - 1)`` (Bessel), ``(a - mean) * rsqrt(var + eps)``,
with ``N = sum(m)``, and the mean added back when ``shift_mean`` is False. Two deliberate departures where
slime's code is a hazard, on purpose, both identical to slime on ordinary inputs:
- the variance is computed in two passes (the mean first, then squared deviations) instead of
  ``E[a^2] - mean^2``, so constant inputs give exactly 0 variance rather than a tiny negative number and NaN;
- with fewer than 2 unmasked tokens the values are only centred, not scaled: slime leaves the variance at
  0 there and multiplies by ``rsqrt(eps)``, about 1e4.
A mask that is 0 everywhere (over all ranks) raises, as in slime.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over everything, or over ``dim``."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the unmasked entries (over everything or over ``dim``); 0 where nothing is unmasked."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def _all_reduce_sum(t: torch.Tensor, distributed: bool, group) -> torch.Tensor:
    # Without an initialised process group (world of one) the local sums already are the global sums.
    if distributed and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  distributed: bool = False, group=None) -> torch.Tensor:
    """Whiten ``values`` over the entries where ``mask`` is 1 (see the module docstring). Returns fp32.

    With ``distributed=True`` the sums are all-reduced over ``group`` (default: the world), so every rank
    must call it, even one whose mask is empty; the statistics are then those of all ranks' tokens.
    """
    values, mask = values.float(), mask.float()
    stats = _all_reduce_sum(torch.stack([masked_sum(values, mask), mask.sum()]), distributed, group)  # (2,)
    total, count = stats[0], stats[1]
    if count.item() == 0:
        raise ValueError("masked_whiten: every entry is masked (loss mask sum is 0); there is nothing to normalise")
    mean = total / count
    # second pass: squared deviations from the global mean (runs on every rank so collectives stay aligned)
    sq_dev = _all_reduce_sum(masked_sum((values - mean) ** 2, mask).reshape(1), distributed, group)[0]
    if count.item() < 2:
        whitened = values - mean
    else:
        whitened = (values - mean) * torch.rsqrt(sq_dev / (count - 1) + eps)
    return whitened if shift_mean else whitened + mean


def distributed_masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                              group=None) -> torch.Tensor:
    """``masked_whiten`` over all ranks of ``group`` (slime's name); a collective call."""
    return masked_whiten(values, mask, shift_mean=shift_mean, eps=eps, distributed=True, group=group)
