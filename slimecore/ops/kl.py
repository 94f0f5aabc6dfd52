"""KL estimators (slime 4.2), with ``delta = log_probs - base_log_probs`` in fp32:
k1 = delta; k2 = delta^2 / 2; k3 = exp(-delta) - 1 + delta; low_var_kl = clamp(k3, -10, 10).
The optional importance ratio multiplies the estimate before the low_var_kl clamp (``--use-unbiased-kl``).
k3 stays unclamped, as in slime; use low_var_kl for a bounded estimate.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(log_probs: torch.Tensor, base_log_probs: torch.Tensor, kind: str = "k1",
              importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    delta = log_probs.float() - base_log_probs.float()
    if kind == "k1":
        kl = delta
    elif kind == "k2":
        kl = delta**2 / 2
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-delta) - 1 + delta
    else:
        raise ValueError(f"unknown KL type {kind!r}; --kl-loss-type takes one of {', '.join(KL_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kind == "low_var_kl":
        kl = kl.clamp(-10, 10)
    return kl
