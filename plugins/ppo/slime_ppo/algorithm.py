"""PPO-family estimators exactly as slime computes them (reference/slime.md 4.3, 4.6), per sample over its
response tokens (all tensors ``(R,)``):

- GAE: token rewards ``rho_t = -kl_coef * kl_t``, plus ``r`` on the last response token;
  ``delta_t = rho_t + gamma V_{t+1} - V_t`` (``V_R = 0``), ``A_t = delta_t + gamma lambda A_{t+1}``,
  ``returns = A + V``. Like slime, the loss mask is not used inside GAE.
- REINFORCE++: ``rho_t = -kl_coef * kl_t * m_t``, plus ``r`` at the last token with ``m = 1``;
  ``G_t = rho_t + gamma G_{t+1}``; advantages = returns = G.
- REINFORCE++-baseline: ``A_t = r - kl_coef * kl_t`` with ``r`` already group-mean-centred.
- Value loss: ``max((V_clip - R)^2, (V - R)^2)`` with ``V_clip = V_old + clamp(V - V_old, -c, c)``;
  no 0.5 factor; ``clipfrac = 1[|V - V_old| > c]``.
"""

from __future__ import annotations

import torch


def gae(reward: float, values: torch.Tensor, kl: torch.Tensor, kl_coef: float, gamma: float, lambd: float):
    rho = -kl_coef * kl.float()
    rho[-1] += reward
    advantages = torch.zeros_like(rho)
    next_value, running = 0.0, 0.0
    for t in reversed(range(rho.numel())):
        delta = rho[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


def reinforce_plus_plus_returns(reward: float, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float, gamma: float):
    rho = -kl_coef * kl.float() * mask
    trainable = mask.nonzero()
    if trainable.numel():
        rho[int(trainable[-1])] += reward
    returns = torch.zeros_like(rho)
    running = 0.0
    for t in reversed(range(rho.numel())):
        running = rho[t] + gamma * running
        returns[t] = running
    return returns


def reinforce_plus_plus_baseline(reward: float, kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    return reward - kl_coef * kl.float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float):
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    return loss, ((values - old_values).abs() > clip).float()
