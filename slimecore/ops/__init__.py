"""Shared RL math for plugins and trainers: log-probs, masked statistics, KL estimators, loss reducers, the PPO-clip
policy loss.

The names load from their modules on first use (PEP 562), so ``from slimecore.ops.kl import KL_TYPES`` in a
plugin's options costs no torch import in the driver."""

import importlib

_WHERE = {
    "KL_TYPES": "kl", "approx_kl": "kl",
    "entropy_from_logits": "logprobs", "log_probs_and_entropy": "logprobs", "log_probs_from_logits": "logprobs",
    "per_sample_response_log_probs": "logprobs", "response_positions": "logprobs",
    "linear_log_probs_and_entropy": "linear_logprobs",
    "distributed_masked_whiten": "masked", "masked_mean": "masked", "masked_sum": "masked", "masked_whiten": "masked",
    "clipped_surrogate": "ppo_clip", "policy_loss": "ppo_clip",
    "Reducer": "reducers", "make_sample_mean_reducer": "reducers", "make_token_mean_reducer": "reducers",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'slimecore.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"slimecore.ops.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
