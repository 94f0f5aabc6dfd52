"""PPO-family estimators exactly as slime computes them (its ``compute_advantages_and_returns`` and
``value_loss_function``).

Every function works on one sample's response tokens; all tensors are ``(R,)`` with ``R`` the response
length, ``reward`` is the sample's scalar reward ``r`` after reward post-processing, ``kl`` the per-token
KL estimate between the old and the reference policy (zeros when ``kl_coef`` is 0).

- GAE (``ppo``): token rewards ``rho_t = -kl_coef * kl_t``, plus ``r`` on the last *response* token;
  ``delta_t = rho_t + gamma V_{t+1} - V_t`` with ``V_R = 0``, ``A_t = delta_t + gamma lambda A_{t+1}``,
  ``returns = A + V``. As in slime, the loss mask is not used inside GAE.
- REINFORCE++ (``reinforce_plus_plus``): ``rho_t = -kl_coef * kl_t * m_t``, plus ``r`` at the last token with
  ``m = 1``; ``G_t = rho_t + gamma G_{t+1}``; advantages = returns = G.
- REINFORCE++-baseline (``reinforce_plus_plus_baseline``): ``A_t = r - kl_coef * kl_t`` with ``r`` already
  group-mean-centred; returns = A.
- Clipped value loss: ``max((V_clip - R)^2, (V - R)^2)`` with ``V_clip = V_old + clamp(V - V_old, -c, c)``;
  no 0.5 factor; ``clipfrac = 1[|V - V_old| > c]``.

Both reinforce++ variants are followed by ``--normalize-advantages`` (token whitening over the step), which
slime requires; that step is the core's ``slimecore.ops.masked.masked_whiten``, not repeated here.
"""

from __future__ import annotations

import torch


def gae(reward: float, values: torch.Tensor, kl: torch.Tensor, kl_coef: float, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``(R,)``, from the critic's ``values`` ``(R,)`` and ``kl`` ``(R,)``."""
    values = values.float()
    rho = -kl_coef * kl.float()
    if rho.numel():
        rho[-1] += reward
    advantages = torch.zeros_like(rho)
    next_value, running = 0.0, 0.0  # V_R = 0 and A_R = 0 past the last token
    for t in reversed(range(rho.numel())):
        delta = rho[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


def reinforce_plus_plus_returns(reward: float, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                                gamma: float) -> torch.Tensor:
    """Discounted returns ``(R,)``; the reward sits on the last token with ``mask == 1`` (none: no reward)."""
    mask = mask.float()
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
    """Advantages ``(R,)`` = returns: the group-centred reward minus the per-token KL penalty."""
    return reward - kl_coef * kl.float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and clip indicator, each ``(R,)``; reduce both with the step's reducer."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    return loss, ((values - old_values).abs() > clip).float()
