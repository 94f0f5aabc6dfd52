"""The log-prob parity stop (``--max-logprob-mismatch``): a step whose train vs rollout log-prob difference
(``train/train_rollout_logprob_abs_diff``, slime's metric) crosses the bound stops the run.

The difference says the trainer does not score the rollout's tokens as the engine did: weights that did not
sync, a numerics change (an engine or kernel upgrade, bf16 paths that drifted apart), a tokenizer or chat
template that differs between the two. Off by default: on CPU both sides run fp32 and differ by ~1e-5; on bf16
GPU runs slime-scale models sit around 1e-2, so 0.1 is a bound that only a real fault crosses.

Each rank writes the step's offending samples (those whose own mean difference crosses the bound, else the
worst ones) in ``samples.jsonl``'s format with both log-prob vectors to
``<log-dir>/logprob_mismatch/step<N>_rank<r>.jsonl``, and raises :class:`LogprobMismatchError` naming the step
and that file. The metric is summed over ranks before it is compared, so every rank stops on the same step.
"""

from __future__ import annotations

import json
from pathlib import Path

WORST_SHOWN = 8  # samples dumped when no single one crosses the bound (the aggregate did)


class LogprobMismatchError(RuntimeError):
    """The train vs rollout log-prob difference of a step crossed ``--max-logprob-mismatch``."""


def sample_mismatch(train: list[float], rollout: list[float], mask: list[int]) -> float:
    """Mean ``|train - rollout|`` over the sample's loss-masked response tokens (0 when none is masked in)."""
    diffs = [abs(a - b) for a, b, m in zip(train, rollout, mask) if m]
    return sum(diffs) / len(diffs) if diffs else 0.0


def dump_rows(rollout_id: int, data: dict, train_log_probs: list, bound: float, tokenizer=None) -> list[dict]:
    """The rows to dump, worst first: ``samples.jsonl``'s fields plus ``rollout_log_probs``, ``train_log_probs``
    and ``logprob_mismatch`` (the sample's own mean difference). ``data`` is the rank's training columns."""
    rows = []
    for i, train in enumerate(train_log_probs):
        if train is None:
            continue
        train = [float(x) for x in (train.tolist() if hasattr(train, "tolist") else train)]
        rollout = [float(x) for x in data["rollout_log_probs"][i]]
        mask = list(data["loss_masks"][i])
        length = data["response_lengths"][i]
        tokens = list(data["tokens"][i])
        prompt_ids, response_ids = tokens[:len(tokens) - length], tokens[len(tokens) - length:]
        rows.append({
            "step": rollout_id, "index": data["sample_indices"][i] if "sample_indices" in data else i,
            "prompt": tokenizer.decode(prompt_ids) if tokenizer else prompt_ids,
            "response": tokenizer.decode(response_ids) if tokenizer else response_ids,
            "reward": data["raw_rewards"][i] if "raw_rewards" in data else None, "response_length": length,
            "weight_versions": data["weight_versions"][i] if "weight_versions" in data else None,
            "logprob_mismatch": sample_mismatch(train, rollout, mask),
            "rollout_log_probs": rollout, "train_log_probs": train, "loss_mask": mask})
    rows.sort(key=lambda r: -r["logprob_mismatch"])
    over = [r for r in rows if r["logprob_mismatch"] > bound]
    return over or rows[:WORST_SHOWN]


def stop_on_mismatch(config, rollout_id: int, rank: int, value: float, data: dict, train_log_probs: list) -> None:
    """Dump this rank's offending samples and raise :class:`LogprobMismatchError`."""
    from slimecore.hf_checkpoint import load_tokenizer

    bound = config.max_logprob_mismatch
    rows = dump_rows(rollout_id, data, train_log_probs, bound, load_tokenizer(config.hf_checkpoint))
    path = Path(config.log_dir or ".") / "logprob_mismatch" / f"step{rollout_id}_rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows), encoding="utf-8")
    raise LogprobMismatchError(
        f"step {rollout_id}: train/train_rollout_logprob_abs_diff {value:.4g} > --max-logprob-mismatch {bound:g}: "
        "the trainer does not score the rollout's tokens as the engine did (weights that did not sync, an engine or "
        "kernel change, a tokenizer or chat template that differs). The step's offending samples, with both "
        f"log-prob vectors, are in {path}; raise the bound or drop --max-logprob-mismatch to go on")
