"""KL estimators (slime's ``compute_approx_kl``), computed in fp32 on ``delta = log_probs - base_log_probs``:

| kind         | per-token value                     |
|--------------|-------------------------------------|
| ``k1``       | ``delta``                           |
| ``k2``       | ``delta^2 / 2``                     |
| ``k3``       | ``exp(-delta) - 1 + delta``         |
| ``low_var_kl`` | k3, then ``clamp(-10, 10)``       |

``importance_ratio`` (slime's ``--use-unbiased-kl``) multiplies the estimate before the low_var_kl clamp;
it is used as given (not detached), as in slime.

k3 stays unclamped to match slime; use ``low_var_kl`` for a bounded estimate. One guard, which changes
nothing where slime's value is finite: the exponent ``-delta`` is capped at 88 before ``exp`` so it
cannot overflow fp32 (``exp(88.7)`` is the fp32 maximum). Without it, ``delta < -88.7`` gives ``inf`` for
k3, and for low_var_kl a NaN gradient (the clamp's zero gradient times ``exp = inf``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor methods only: importing this module (KL_TYPES in a plugin's options) loads no torch
    import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
_MAX_EXPONENT = 88.0  # exp(88) ~ 1.65e38 < fp32 max 3.4e38


def approx_kl(log_probs: torch.Tensor, base_log_probs: torch.Tensor, kind: str = "k1",
              importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(policy || base) estimate; inputs (...) -> (...) fp32."""
    delta = log_probs.float() - base_log_probs.float()
    if kind == "k1":
        kl = delta
    elif kind == "k2":
        kl = delta**2 / 2
    elif kind in ("k3", "low_var_kl"):
        kl = (-delta).clamp(max=_MAX_EXPONENT).exp() - 1 + delta
    else:
        raise ValueError(f"unknown KL type {kind!r}; --kl-loss-type takes one of {', '.join(KL_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kind == "low_var_kl":
        kl = kl.clamp(-10, 10)
    return kl
