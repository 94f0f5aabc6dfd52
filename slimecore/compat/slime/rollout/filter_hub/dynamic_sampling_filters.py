"""slime-core shim of slime's dynamic-sampling filters, with slime's rule: keep a group iff the (unbiased) std
of its rewards exceeds 1e-6."""

from __future__ import annotations

import torch

from slimecore.types import FilterResult as DynamicFilterOutput


def check_reward_nonzero_std(args, samples, **kwargs):
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = bool(torch.tensor(rewards, dtype=torch.float64).std() > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args, samples, **kwargs):
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]
