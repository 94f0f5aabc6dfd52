"""Shared RL math used by many plugins: log-probs, masked statistics, KL estimators, loss reducers."""

from slimecore.ops.kl import approx_kl
from slimecore.ops.logprobs import entropy_from_logits, log_probs_from_logits
from slimecore.ops.masked import masked_mean, masked_sum, masked_whiten
from slimecore.ops.reducers import make_sample_mean_reducer, make_token_mean_reducer

__all__ = ["approx_kl", "entropy_from_logits", "log_probs_from_logits", "masked_mean", "masked_sum", "masked_whiten",
           "make_sample_mean_reducer", "make_token_mean_reducer"]
