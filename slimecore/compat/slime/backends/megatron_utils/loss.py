"""slime-core shim of the one function of ``slime.backends.megatron_utils.loss`` custom losses call:
``get_log_probs_and_entropy``. In a slime-core run the ``logits`` a custom loss gets already carry the response
log-probs and entropies (``slimecore.defaults.slime_compat.ResponseLogits``, temperature applied, with gradient);
this returns them in slime's shape: ``(empty tensor, {"log_probs": [...], "entropy": [...]})``."""

from __future__ import annotations

import torch

from slimecore.defaults.slime_compat import ResponseLogits


def get_log_probs_and_entropy(logits, *, args=None, unconcat_tokens=None, total_lengths=None, response_lengths=None,
                              with_entropy: bool = False, non_loss_data: bool = True, **kwargs):
    if not isinstance(logits, ResponseLogits):
        raise TypeError("slime-core's get_log_probs_and_entropy takes the logits a custom loss was called with "
                        f"(response log-probs from the trainer), got {type(logits).__name__}")
    if response_lengths is not None and [len(lp) for lp in logits.log_probs] != list(response_lengths):
        raise ValueError(f"response_lengths {list(response_lengths)} do not match the micro-batch's responses "
                         f"{[len(lp) for lp in logits.log_probs]}; pass batch['response_lengths']")
    result = {"log_probs": list(logits.log_probs)}
    if with_entropy:
        result["entropy"] = list(logits.entropy)
    return torch.empty((0,)), result


__all__ = ["get_log_probs_and_entropy"]
