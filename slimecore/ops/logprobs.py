"""Log-probs and entropy from logits (slime 4.8): logits are divided by the rollout temperature so the
trainer scores tokens under the same distribution the engine sampled from."""

from __future__ import annotations

import torch


def log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` in fp32. logits (..., V), targets (...) -> (...)."""
    scaled = logits.float() / temperature
    return torch.gather(scaled, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``H = logsumexp(z) - sum softmax(z) z`` with ``z = logits / T``. (..., V) -> (...)."""
    z = logits.float() / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
