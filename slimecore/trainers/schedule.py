"""Data-parallel schedule, built on the rollout manager ("pack first, distribute second", slime 1.5).

1. Samples are grouped by rollout id; each optimizer step takes exactly ``global_batch_size`` rollouts
   (a trailing incomplete step is dropped and counted).
2. A step's samples are packed into micro-batches: first-fit under ``max_tokens_per_gpu`` (dynamic) or
   chunks of ``micro_batch_size`` (static). A sample longer than the budget gets a micro-batch alone.
3. The micro-batch count is raised to a multiple of the DP size by splitting the largest bins; when a
   step has fewer samples than ranks, some ranks get an empty micro-batch (zero loss, same collectives).
4. Micro-batches go to ranks round-robin, so every rank runs the same number of micro-batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("slimecore.schedule")


@dataclass
class Schedule:
    partitions: list[list[int]]  # per rank: global sample indices owned, in local order
    steps: list[list[dict]]  # per rank, per step: {"micro_batches": [[local idx]], "num_rollouts", "num_tokens"}
    dropped_rollouts: int = 0
    oversized_samples: list[int] = field(default_factory=list)


def _pack(indices: list[int], lengths: list[int], micro_batch_size: int | None, max_tokens: int | None,
          oversized: list[int]) -> list[list[int]]:
    if max_tokens is None:
        size = micro_batch_size or 1
        return [indices[i:i + size] for i in range(0, len(indices), size)]
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in indices:
        if lengths[i] > max_tokens:
            oversized.append(i)
            log.warning("sample %d has %d tokens, more than --max-tokens-per-gpu %d; it gets a micro-batch alone",
                        i, lengths[i], max_tokens)
            bins.append([i])
            loads.append(lengths[i])
            continue
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _split_to_multiple(bins: list[list[int]], lengths: list[int], dp_size: int) -> list[list[int]]:
    while len(bins) % dp_size:
        largest = max(range(len(bins)), key=lambda b: (len(bins[b]) > 1, sum(lengths[i] for i in bins[b])))
        if len(bins[largest]) > 1:
            half = len(bins[largest]) // 2
            bins[largest:largest + 1] = [bins[largest][:half], bins[largest][half:]]
        else:
            bins.append([])  # fewer samples than ranks: an empty micro-batch keeps collectives aligned
    return bins


def build_dp_schedule(rollout_ids: list[int], lengths: list[int], global_batch_size: int, dp_size: int,
                      micro_batch_size: int | None = 1, max_tokens_per_gpu: int | None = None) -> Schedule:
    order: dict[int, list[int]] = {}
    for i, rid in enumerate(rollout_ids):
        order.setdefault(rid, []).append(i)
    rollouts = list(order.values())
    num_steps = len(rollouts) // global_batch_size
    dropped = len(rollouts) - num_steps * global_batch_size
    if dropped:
        log.warning("%d rollouts do not fill an optimizer step of --global-batch-size %d and are not trained",
                    dropped, global_batch_size)
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    steps: list[list[dict]] = [[] for _ in range(dp_size)]
    oversized: list[int] = []
    for step in range(num_steps):
        members = [i for r in rollouts[step * global_batch_size:(step + 1) * global_batch_size] for i in r]
        bins = _split_to_multiple(_pack(members, lengths, micro_batch_size, max_tokens_per_gpu, oversized),
                                  lengths, dp_size)
        num_tokens = None  # filled by split_for_ranks from the loss masks
        for rank in range(dp_size):
            local = []
            for b in bins[rank::dp_size]:
                start = len(partitions[rank])
                partitions[rank].extend(b)
                local.append(list(range(start, start + len(b))))
            steps[rank].append({"micro_batches": local, "num_rollouts": global_batch_size, "num_tokens": num_tokens,
                                "members": members})
    return Schedule(partitions, steps, dropped, oversized)


PER_SAMPLE_KEYS = ("tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "rollout_log_probs",
                   "rollout_ids", "sample_indices", "truncated", "weight_versions")


def split_for_ranks(train_data: dict, schedule: Schedule) -> list[dict]:
    """Slice the manager's columns per rank and attach the loss denominators and the step layout."""
    masks = train_data["loss_masks"]
    per_rollout: dict[int, int] = {}
    for rid, mask in zip(train_data["rollout_ids"], masks):
        per_rollout[rid] = per_rollout.get(rid, 0) + sum(mask)
    mask_sums = [float(per_rollout[rid]) for rid in train_data["rollout_ids"]]
    out = []
    for rank, part in enumerate(schedule.partitions):
        data = {key: [train_data[key][i] for i in part] for key in PER_SAMPLE_KEYS if key in train_data}
        data["rollout_mask_sums"] = [mask_sums[i] for i in part]
        data["steps"] = [{"micro_batches": s["micro_batches"], "num_rollouts": s["num_rollouts"],
                          "num_tokens": sum(sum(masks[i]) for i in s["members"])} for s in schedule.steps[rank]]
        out.append(data)
    return out
