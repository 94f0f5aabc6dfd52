"""Every installed algorithm's real loss gives the same loss and gradients (1e-6) whatever the
micro-batching and the number of DP ranks: grpo (with KL loss, clip-higher, dual clip, entropy; TIS;
ICEPOP; CISPO; REINFORCE with the current-policy TIS weight), gspo,
ppo's actor and critic, reinforce++ and reinforce++-baseline (whose advantage whitening spans the DP ranks).

The plugins are loaded as a run loads them; only the batch is synthetic (``test_fsdp_trainer._data``). The
micro-batching test runs on the CPU and, marked ``gpu``, on CUDA (``tests/devices.py``: tolerances per device)."""

from __future__ import annotations

import random

import pytest
import torch

from devices import DEVICES, fp32_strict, tolerance
from slimecore.config import Config
from slimecore.plugins import load_plugins
from slimecore.testing.distributed import run_ranks
from slimecore.trainers.trainer import Trainer
from test_fsdp_trainer import _data, _flat_grads, _part

pytest.importorskip("slime_ppo", reason="the algorithm plugins are installed by scripts/setup.sh")

# (case name, plugin, plugin option overrides, role)
CASES = [
    ("grpo", "grpo", {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3", "entropy_coef": 0.01,
                      "eps_clip_high": 0.28, "eps_clip_c": 3.0}, "actor"),
    ("grpo-tis", "grpo", {"use_tis": True, "tis_clip": 1.5}, "actor"),
    ("grpo-icepop", "grpo", {"use_tis": True, "tis_mode": "icepop", "tis_clip_low": 0.5, "tis_clip": 5.0}, "actor"),
    ("cispo", "grpo", {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 0.28}, "actor"),
    ("reinforce-tis-current", "grpo", {"advantage_estimator": "reinforce", "use_tis": True, "tis_mode": "current",
                                       "tis_clip": 1.5}, "actor"),
    ("gspo", "gspo", {}, "actor"),
    ("ppo-actor", "ppo", {"kl_coef": 0.05, "normalize_advantages": True}, "actor"),
    ("ppo-critic", "ppo", {}, "critic"),
    ("reinforce++", "ppo", {"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True,
                            "kl_coef": 0.05, "gamma": 0.9}, "actor"),
    ("reinforce++-baseline", "ppo", {"advantage_estimator": "reinforce_plus_plus_baseline",
                                     "normalize_advantages": True}, "actor"),
]


def _config(checkpoint, plugin: str, overrides: dict, rollouts: int) -> Config:
    defaults = {o.name: o.default for o in load_plugins([plugin]).slime_options()[plugin]}
    return Config.make(plugins=[plugin], plugin_values={plugin: defaults | overrides}, hf_checkpoint=str(checkpoint),
                       lr=1e-3, rollout_batch_size=rollouts, global_batch_size=rollouts)


def _case_data(role: str):
    data = _data(rollout_log_probs=True)
    rng = random.Random(7)
    data["rollout_log_probs"] = [[rng.uniform(-8, -1) for _ in range(n)] for n in data["response_lengths"]]
    if role == "critic":  # the actor's returns
        data["returns"] = [[rng.uniform(-1, 1) for _ in range(n)] for n in data["response_lengths"]]
    else:  # the critic's values (used by GAE only)
        data["values"] = [[rng.uniform(-0.5, 0.5) for _ in range(n)] for n in data["response_lengths"]]
    return data


def _train(checkpoint, case, dp_size=1, rank=0, device=None, **part_kw):
    name, plugin, overrides, role = case
    data = _case_data(role)
    config = _config(checkpoint, plugin, overrides, len(set(data["rollout_ids"])))
    torch.manual_seed(0)
    trainer = Trainer(config, load_plugins([plugin]), rank=rank, world_size=dp_size, role=role, device=device)
    metrics = trainer.train(0, _part(data, dp_size=dp_size, rank=rank, **part_kw))
    return metrics, _flat_grads(trainer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_micro_batching_does_not_change_the_loss_or_gradients(tiny_checkpoint, case, device):
    tol = tolerance(device)
    with fp32_strict():
        m1, g1 = _train(tiny_checkpoint, case, device=device, micro_batch_size=8)
    assert g1.device.type == device and g1.abs().max().item() > 0
    loss_key = "train/value_loss" if case[3] == "critic" else "train/pg_loss"
    for part_kw in ({"micro_batch_size": 2}, {"micro_batch_size": None, "max_tokens": 20}):
        with fp32_strict():
            m, g = _train(tiny_checkpoint, case, device=device, **part_kw)
        for key in ("train/loss", loss_key, "train/grad_norm"):
            assert m[key] == pytest.approx(m1[key], abs=tol), (key, part_kw)
        assert (g - g1).abs().max().item() < tol, part_kw


def _per_rank(rank, world, checkpoint):
    results = {}
    for case in CASES:
        metrics, grads = _train(checkpoint, case, dp_size=world, rank=rank, micro_batch_size=1)
        results[case[0]] = (metrics["train/loss"], metrics["train/grad_norm"], grads.cpu().numpy())
    return results


def test_two_dp_ranks_match_one_for_every_algorithm(tiny_checkpoint):
    expected = {case[0]: _train(tiny_checkpoint, case, micro_batch_size=3) for case in CASES}
    for by_case in run_ranks(_per_rank, str(tiny_checkpoint)):
        for name, (loss, norm, grads) in by_case.items():
            metrics, want = expected[name]
            assert loss == pytest.approx(metrics["train/loss"], abs=1e-6), name
            assert norm == pytest.approx(metrics["train/grad_norm"], abs=1e-6), name
            assert (torch.from_numpy(grads) - want.cpu()).abs().max().item() < 1e-6, name
