"""Supervised fine-tuning through the slime-core loop: ``slime-core train --plugin sft``.

Variant implemented: slime's SFT (``--rollout-function-path slime.rollout.sft_rollout.generate_rollout
--loss-type sft_loss --disable-compute-advantages-and-returns --debug-train-only``).
- Data: each step draws ``--rollout-batch-size`` conversations (``slime_sft.data``), tokenised and masked to
  their assistant turns by ``slime_sft.masks``; no generation, reward 0.
- Loss: the negative log-likelihood of the trained tokens, ``-log p(y_t | y_<t)`` at temperature 1, reduced
  like every loss here: by default slime's sum of sample means, ``J = (1/B) sum_i sum_t -logp_it m_it / sum_t m_it``
  (the mean over conversations of each one's token mean; ``B`` conversations in the optimizer step), or with
  ``--calculate-per-token-loss`` the token mean over the step, ``sum -logp m / N``. Either is independent of
  the micro-batch and data-parallel split.
- No old-policy, reference or value passes; advantages and returns are zeros (slime computes none).
- No inference engines and no weight sync: the plugin implies ``--no-engines`` (slime: ``--debug-train-only``) and
  ``--n-samples-per-prompt 1`` (``slime_implied_options``); a contrary flag is a start-up error.

Where it departs from slime:
- Masks come from the tokenizer's own chat template rendered prefix by prefix (``slime_sft.masks``), so there
  is no ``--loss-mask-type``; slime's multi-turn mask bugs #1563, #1476 and #1490 do not arise. The response
  runs from the first trained token to the end, keeping the zeros of the turns in between.
- ``--sft-max-len`` truncates conversations (slime has no such option); those left without a trained token
  are dropped at start-up and counted, not trained as empty samples.
- Bad rows, flags with no effect in SFT (``--eval-prompt-data``, ``--rollout-temperature``, ...) and a chat
  template that breaks the prefix property are start-up errors naming the row or flag.
"""

from __future__ import annotations

import torch

from slimecore import hookimpl
from slimecore.config import ConfigError, Option
from slimecore.data.dataset import DataError
from slimecore.types import RolloutOutput
from slime_sft.data import SFTDataSource, read_conversations

NAME = "sft"
# core options that do nothing without generation; setting one is a mistake worth stopping for
NO_EFFECT = {
    "eval_prompt_data": "SFT starts no inference engines to evaluate with; evaluate a --save checkpoint in a "
                        "separate run",
    "over_sampling_batch_size": "SFT generates nothing to over-sample",
    "partial_rollout": "SFT generates nothing to interrupt",
    "mask_offpolicy_in_partial_rollout": "SFT generates nothing off-policy",
    "group_rm": "SFT computes no rewards",
    "rm_type": "SFT computes no rewards",
    "rollout_max_prompt_len": "SFT has no prompts to drop; --sft-max-len truncates conversations",
}


@hookimpl
def slime_options():
    return [Option("sft_max_len", int, None, "Truncate each conversation to this many tokens; conversations "
                   "left with no trained token are dropped at start-up (counted in the log).")]


@hookimpl
def slime_implied_options():
    return {"engines": False, "n_samples_per_prompt": 1}


@hookimpl
def slime_validate_config(config):
    if config.rollout_batch_size is None:
        raise ConfigError("--rollout-batch-size is required with --plugin sft: the number of conversations per step")
    if config.rollout_temperature != 1.0:
        raise ConfigError(f"--rollout-temperature {config.rollout_temperature} with --plugin sft: the trainer divides "
                          "the logits by it, so the loss would be the NLL of a tempered model; drop the flag")
    for name, why in NO_EFFECT.items():
        if getattr(config, name):
            raise ConfigError(f"--{name.replace('_', '-')} has no effect with --plugin sft ({why}); drop it")
    max_len = config.plugin(NAME).sft_max_len
    if max_len is not None and max_len < 2:
        raise ConfigError(f"--sft-max-len must be >= 2 (got {max_len}): a trained token needs one before it")
    try:  # every row's structure, before Ray starts
        read_conversations(config)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


@hookimpl
def slime_data_source(config, tokenizer):
    return SFTDataSource.load(config, tokenizer, config.plugin(NAME).sft_max_len)


@hookimpl
async def slime_rollout(config, data_source, evaluation):
    if evaluation:
        raise RuntimeError("--plugin sft has no eval rollout (it starts no inference engines); drop --eval-prompt-data")
    return RolloutOutput(data_source.get_samples(config.rollout_batch_size))


@hookimpl
def slime_train_inputs(config, role):
    return []


@hookimpl
def slime_compute_advantages(config, role, batch):
    zeros = [torch.zeros(n) for n in batch["response_lengths"]]
    return {"advantages": zeros, "returns": zeros}


@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    return sft_loss(outputs["log_probs"], reducer)


def sft_loss(log_probs: list[torch.Tensor], reducer) -> tuple[torch.Tensor, dict]:
    """Token NLL of one micro-batch, reduced to its share of the step objective. log_probs: per sample (R_i,)."""
    return reducer([-lp for lp in log_probs]), {}
