"""Masked statistics. ``masked_whiten`` follows slime's ``distributed_masked_whiten`` (4.4) but is safe
where slime's is a hazard (DESIGN.md section 8):
- the variance is computed in two passes (mean first, then squared deviations), so constant inputs give
  exactly 0 instead of a tiny negative number and NaN;
- with fewer than 2 unmasked tokens the values are only centred, not scaled (slime multiplies a single
  token by about 1e4).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over unmasked entries; 0 where nothing is unmasked."""
    return masked_sum(values, mask, dim) / mask.sum(dim if dim is not None else None).clamp(min=1)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        dist.all_reduce(t, group=group)
    return t


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  distributed: bool = False, group=None) -> torch.Tensor:
    """Whiten ``values`` over the unmasked entries (all ranks' entries when ``distributed``).

    ``mean = sum(a m) / N``, ``var = sum((a - mean)^2 m) / N * N / (N - 1)`` (Bessel), result
    ``(a - mean) * rsqrt(var + eps)`` (mean added back when ``shift_mean`` is False).
    """
    values, mask = values.float(), mask.float()
    stats = torch.stack([(values * mask).sum(), mask.sum()])
    if distributed:
        _all_reduce(stats, group)
    total, count = stats[0], stats[1]
    if count == 0:
        raise ValueError("masked_whiten: every entry is masked; there is nothing to normalise")
    mean = total / count
    sq = ((values - mean) ** 2 * mask).sum().reshape(1)
    if distributed:
        _all_reduce(sq, group)
    if count < 2:
        whitened = values - mean
    else:
        var = sq[0] / count * (count / (count - 1))
        whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean
