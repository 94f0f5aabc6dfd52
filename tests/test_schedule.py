"""DP schedule: whole rollouts per step, equal micro-batch counts per rank, token budget, per-rank data."""

import logging

import pytest

from slimecore.rollout.schedule import build_dp_schedule, split_for_ranks


def _data(lengths, rollout_ids, masks=None):
    n = len(lengths)
    masks = masks or [[1, 1] for _ in range(n)]
    return {"tokens": [[7] * L for L in lengths], "response_lengths": [len(m) for m in masks], "loss_masks": masks,
            "rewards": [float(i) for i in range(n)], "raw_rewards": [0.0] * n, "rollout_ids": list(rollout_ids),
            "sample_indices": list(range(n)), "truncated": [0] * n, "note": "whole-batch value"}


def _owned(parts):
    return sorted(i for p in parts for i in p["sample_indices"])


def test_steps_take_whole_rollouts_and_ranks_get_equal_micro_batch_counts():
    rollout_ids = [0, 0, 1, 2, 3, 4, 5, 5, 6]  # 7 rollouts; 0 and 5 fan out into two samples
    lengths = [5] * 9
    s = build_dp_schedule(rollout_ids, lengths, global_batch_size=3, dp_size=2, micro_batch_size=1)
    assert len(s.steps) == 2 and s.dropped_rollouts == 1 and s.dropped_samples == [8]
    parts = split_for_ranks(_data(lengths, rollout_ids), s)
    assert _owned(parts) == list(range(8))
    for step in range(2):
        counts = [len(p["steps"][step]["micro_batches"]) for p in parts]
        assert counts[0] == counts[1]
        step_samples = {p["sample_indices"][i] for p in parts for mb in p["steps"][step]["micro_batches"] for i in mb}
        assert len({rollout_ids[i] for i in step_samples}) == 3  # exactly global_batch_size rollouts
    assert parts[0]["steps"][0]["num_rollouts"] == 3 and parts[0]["steps"][0]["num_tokens"] == 8
    sums = {i: d for p in parts for i, d in zip(p["sample_indices"], p["rollout_mask_sums"])}
    assert sums[0] == sums[1] == 4.0 and sums[2] == 2.0
    assert all(p["note"] == "whole-batch value" for p in parts)
    assert all(p["rewards"] == [float(i) for i in p["sample_indices"]] for p in parts)  # per-sample keys sliced


def test_static_mode_splits_to_a_multiple_of_dp_and_pads_small_steps():
    s = build_dp_schedule(list(range(5)), [3] * 5, global_batch_size=5, dp_size=2, micro_batch_size=2)
    per_rank = [s.steps[0].rank_micro_batches[r] for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) and all(len(mb) <= 2 for r in per_rank for mb in r)
    assert sorted(i for r in per_rank for mb in r for i in mb) == list(range(5))
    tiny = build_dp_schedule([0], [4], global_batch_size=1, dp_size=2, micro_batch_size=1)
    assert [tiny.steps[0].rank_micro_batches[r] for r in range(2)] == [[[0]], [[]]]  # empty micro-batch on rank 1


def test_dynamic_packing_respects_the_token_budget_and_isolates_oversized(caplog):
    lengths = [6, 6, 6, 20, 3, 5]
    with caplog.at_level(logging.WARNING, logger="slimecore.schedule"):
        s = build_dp_schedule(list(range(6)), lengths, global_batch_size=6, dp_size=2, max_tokens_per_gpu=12)
    assert s.oversized_samples == [3] and "more than --max-tokens-per-gpu" in caplog.text
    mbs = [mb for r in range(2) for mb in s.steps[0].rank_micro_batches[r]]
    assert sorted(i for mb in mbs for i in mb) == list(range(6))  # nothing dropped
    for mb in mbs:
        assert sum(lengths[i] for i in mb) <= 12 or mb == [3]
    assert len(s.steps[0].rank_micro_batches[0]) == len(s.steps[0].rank_micro_batches[1])


def test_fully_masked_rollouts_do_not_count_in_b_and_token_count_is_global():
    masks = [[1, 1], [0, 0], [0, 1], [0, 0]]
    parts = split_for_ranks(_data([4] * 4, [0, 1, 2, 3], masks),
                            build_dp_schedule([0, 1, 2, 3], [4] * 4, global_batch_size=4, dp_size=2,
                                              micro_batch_size=1))
    assert all(p["steps"][0]["num_rollouts"] == 2 and p["steps"][0]["num_tokens"] == 3 for p in parts)


def test_bad_arguments_name_the_flags():
    with pytest.raises(ValueError, match="--micro-batch-size"):
        build_dp_schedule([0], [3], global_batch_size=1, dp_size=1)
    with pytest.raises(ValueError, match="--global-batch-size"):
        build_dp_schedule([0], [3], global_batch_size=0, dp_size=1, micro_batch_size=1)
