"""Data-parallel schedule, built by the rollout manager: "pack first, distribute second", as slime's
``RolloutManager`` splits a rollout batch before sending each DP rank its share.

1. Samples are grouped by rollout id (a rollout is never split across steps). Each optimizer step takes
   exactly ``global_batch_size`` rollouts, in order of first appearance; the trailing rollouts that do not
   fill a step are dropped and counted (``Schedule.dropped_rollouts``, logged).
2. Each step's samples are packed into micro-batches: first-fit under ``max_tokens_per_gpu`` tokens
   (dynamic batching) or chunks of ``micro_batch_size`` samples (static). A sample longer than the budget
   gets a micro-batch of its own and a logged warning; it is never dropped.
3. The micro-batch count is raised to a multiple of the DP size by splitting the micro-batch with the most
   tokens in two (balanced by tokens). slime does this in dynamic mode and asserts in static mode; we split
   in both, since a smaller micro-batch changes nothing in the objective (``slimecore.ops.reducers``).
   When a step has fewer samples than ranks, the remaining ranks get empty micro-batches: the trainer runs
   them as zero-loss forwards so every rank issues the same collectives.
4. Micro-batches are sorted by token count (largest first) and dealt to ranks round-robin, so every rank
   gets the same number per step and roughly the same tokens; with ``--balance-data`` (slime's flag, which
   balances estimated FLOPs by Karmarkar-Karp) each goes to the rank with the fewest tokens so far among those
   that still take one (greedy, largest first), which evens out the ranks' tokens further.

``split_for_ranks`` then slices the manager's column dict for each rank (format in its docstring).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger("slimecore.schedule")


@dataclass
class StepPlan:
    """One optimizer step: its global samples, and per rank the micro-batches of global sample indices."""

    samples: list[int]
    rank_micro_batches: list[list[list[int]]]  # [rank][micro-batch] -> global sample indices


@dataclass
class Schedule:
    steps: list[StepPlan]
    dp_size: int
    dropped_rollouts: int = 0
    dropped_samples: list[int] = field(default_factory=list)
    oversized_samples: list[int] = field(default_factory=list)

    def partition(self, rank: int) -> list[int]:
        """Global sample indices owned by ``rank``, in local order (step by step, micro-batch by micro-batch)."""
        return [i for step in self.steps for mb in step.rank_micro_batches[rank] for i in mb]


def _pack(members: list[int], lengths: Sequence[int], micro_batch_size: int | None, max_tokens: int | None,
          oversized: list[int]) -> list[list[int]]:
    if max_tokens is None:
        return [members[i:i + micro_batch_size] for i in range(0, len(members), micro_batch_size)]
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in members:
        if lengths[i] > max_tokens:
            log.warning("sample %d has %d tokens, more than --max-tokens-per-gpu %d; it gets a micro-batch of its "
                        "own", i, lengths[i], max_tokens)
            oversized.append(i)
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


def _split_in_two(bin_: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Cut a micro-batch where the token prefix first reaches half (both parts non-empty)."""
    total, prefix = sum(lengths[i] for i in bin_), 0
    for cut in range(1, len(bin_)):
        prefix += lengths[bin_[cut - 1]]
        if 2 * prefix >= total:
            return bin_[:cut], bin_[cut:]
    return bin_[:-1], bin_[-1:]


def _to_multiple(bins: list[list[int]], lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    while len(bins) % dp_size:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.append([])  # fewer samples than ranks: an empty micro-batch keeps the ranks in step
            continue
        largest = max(splittable, key=lambda b: sum(lengths[i] for i in bins[b]))
        bins[largest:largest + 1] = list(_split_in_two(bins[largest], lengths))
    return bins


def _deal(bins: list[list[int]], lengths: Sequence[int], dp_size: int, balance: bool) -> list[list[list[int]]]:
    """Micro-batches (largest first) to ranks, the same number each: round-robin, or by greedy token balance."""
    if not balance:
        return [bins[r::dp_size] for r in range(dp_size)]
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for mb in bins:
        r = min((r for r in range(dp_size) if len(ranks[r]) < len(bins) // dp_size), key=lambda r: loads[r])
        ranks[r].append(mb)
        loads[r] += sum(lengths[i] for i in mb)
    return ranks


def build_dp_schedule(rollout_ids: Sequence[int], lengths: Sequence[int], global_batch_size: int, dp_size: int,
                      micro_batch_size: int | None = None, max_tokens_per_gpu: int | None = None,
                      balance: bool = False) -> Schedule:
    """Plan every optimizer step of one rollout batch (see the module docstring).

    ``lengths`` are total token counts (prompt + response) per sample. Dynamic batching is used when
    ``max_tokens_per_gpu`` is given (``micro_batch_size`` is then ignored), static otherwise.
    """
    if len(rollout_ids) != len(lengths):
        raise ValueError(f"{len(rollout_ids)} rollout ids but {len(lengths)} lengths")
    if global_batch_size is None or global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1 (got {global_batch_size})")
    if dp_size < 1:
        raise ValueError(f"the data-parallel size must be >= 1 (got {dp_size})")
    if max_tokens_per_gpu is None and (micro_batch_size is None or micro_batch_size < 1):
        raise ValueError("set --micro-batch-size (>= 1) or --use-dynamic-batch-size with --max-tokens-per-gpu")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1 (got {max_tokens_per_gpu})")

    by_rollout: dict[int, list[int]] = {}
    for i, rid in enumerate(rollout_ids):
        by_rollout.setdefault(rid, []).append(i)
    rollouts = list(by_rollout.values())
    num_steps = len(rollouts) // global_batch_size
    kept = num_steps * global_batch_size
    dropped_samples = [i for r in rollouts[kept:] for i in r]
    if len(rollouts) > kept:
        log.warning("%d of %d rollouts (%d samples) do not fill an optimizer step of --global-batch-size %d and "
                    "are not trained", len(rollouts) - kept, len(rollouts), len(dropped_samples), global_batch_size)

    oversized: list[int] = []
    steps = []
    for s in range(num_steps):
        members = [i for r in rollouts[s * global_batch_size:(s + 1) * global_batch_size] for i in r]
        bins = _to_multiple(_pack(members, lengths, micro_batch_size, max_tokens_per_gpu, oversized), lengths, dp_size)
        bins.sort(key=lambda b: -sum(lengths[i] for i in b))  # stable: ties keep packing order
        steps.append(StepPlan(members, _deal(bins, lengths, dp_size, balance)))
    return Schedule(steps, dp_size, len(rollouts) - kept, dropped_samples, oversized)


def split_for_ranks(train_data: dict, schedule: Schedule) -> list[dict]:
    """Slice the manager's column dict into one dict per DP rank.

    ``train_data`` holds per-sample lists (``tokens``, ``response_lengths``, ``loss_masks``, ``rewards``,
    ``raw_rewards``, ``rollout_ids``, ``sample_indices``, ``truncated``, optional ``rollout_log_probs``,
    ``weight_versions`` ...). Every list with one entry per sample is sliced to the rank's samples in local
    order; anything else (whole-batch values) is copied to every rank unchanged. Added per rank:
    - ``rollout_mask_sums``: per sample, the loss-mask tokens of all samples of its rollout (``D_i``);
    - ``steps``: per optimizer step ``{"micro_batches": [[local index, ...], ...], "num_rollouts": B,
      "num_tokens": N}``, where B is the step's rollouts with at least one trainable token over all ranks
      and N its mask tokens over all ranks (the reducers' global denominators).

    B departs from slime on purpose: slime also counts rollouts whose loss mask is all
    zeros (``remove_sample``), which shrinks every other rollout's weight; here such a rollout adds nothing to
    the numerator and nothing to B. With no fully masked rollout the two agree.
    """
    n = len(train_data["tokens"])
    masks = train_data["loss_masks"]
    rollout_ids = train_data["rollout_ids"]
    mask_tokens = [int(sum(m)) for m in masks]
    per_rollout: dict[int, int] = {}
    for rid, count in zip(rollout_ids, mask_tokens):
        per_rollout[rid] = per_rollout.get(rid, 0) + count

    out = []
    for rank in range(schedule.dp_size):
        part = schedule.partition(rank)
        local = {g: k for k, g in enumerate(part)}
        data = {key: ([value[i] for i in part] if isinstance(value, list) and len(value) == n else value)
                for key, value in train_data.items()}
        data["rollout_mask_sums"] = [float(per_rollout[rollout_ids[i]]) for i in part]
        data["steps"] = []
        for step in schedule.steps:
            step_rollouts = {rollout_ids[i] for i in step.samples}
            data["steps"].append({
                "micro_batches": [[local[i] for i in mb] for mb in step.rank_micro_batches[rank]],
                "num_rollouts": sum(1 for rid in step_rollouts if per_rollout[rid] > 0),
                "num_tokens": sum(mask_tokens[i] for i in step.samples),
            })
        out.append(data)
    return out


def split_rollout_data(config, data: dict, dp_size: int) -> list[dict]:
    """``data`` (rollout columns) as each DP rank's share with its schedule: ``--global-batch-size`` rollouts per
    step, micro-batches by ``--micro-batch-size`` or, with ``--use-dynamic-batch-size``, ``--max-tokens-per-gpu``."""
    dynamic = config.use_dynamic_batch_size
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], config.global_batch_size,
                                 dp_size, None if dynamic else config.micro_batch_size,
                                 config.max_tokens_per_gpu if dynamic else None, config.balance_data)
    return split_for_ranks(data, schedule)
