"""Shared RL math for plugins and trainers: log-probs, masked statistics, KL estimators, loss reducers, the PPO-clip
policy loss."""

from slimecore.ops.kl import KL_TYPES, approx_kl
from slimecore.ops.logprobs import (entropy_from_logits, log_probs_and_entropy, log_probs_from_logits,
                                    per_sample_response_log_probs, response_positions)
from slimecore.ops.masked import distributed_masked_whiten, masked_mean, masked_sum, masked_whiten
from slimecore.ops.ppo_clip import clipped_surrogate, policy_loss
from slimecore.ops.reducers import Reducer, make_sample_mean_reducer, make_token_mean_reducer

__all__ = [
    "KL_TYPES", "Reducer", "approx_kl", "clipped_surrogate", "distributed_masked_whiten", "entropy_from_logits",
    "log_probs_and_entropy", "log_probs_from_logits", "make_sample_mean_reducer", "make_token_mean_reducer",
    "masked_mean", "masked_sum", "masked_whiten", "per_sample_response_log_probs", "policy_loss",
    "response_positions",
]
