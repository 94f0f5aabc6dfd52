"""The training batch's declared forms (``slimecore.types``) are what the stages really make and the hooks see."""

from __future__ import annotations

import typing

import torch

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.plugins import load_plugins
from slimecore.rollout.manager import convert_samples
from slimecore.trainers.trainer import Trainer
from slimecore.rollout.schedule import split_rollout_data
from slimecore.types import ModelOutputs, RankData, RolloutColumns, Sample, TrainBatch


def assert_conforms(value: dict, form: type) -> None:
    """Every required key present, no undeclared key, and the columns declared as tensors hold tensors."""
    keys = set(value)
    assert form.__required_keys__ <= keys, f"{form.__name__} lacks {sorted(form.__required_keys__ - keys)}"
    assert keys <= form.__required_keys__ | form.__optional_keys__, \
        f"{form.__name__} does not declare {sorted(keys - form.__required_keys__ - form.__optional_keys__)}"
    for key, annotation in typing.get_type_hints(form, localns={"torch": torch}).items():
        if key in value and value[key] is not None and annotation == list[torch.Tensor]:
            assert all(isinstance(t, torch.Tensor) for t in value[key]), f"{form.__name__}[{key!r}] holds tensors"


def _samples() -> list[Sample]:
    samples = []
    for i in range(4):
        sample = Sample(index=i, group_index=i // 2, tokens=[5, 6, 7], reward=float(i % 2))
        sample.append_response_tokens([8 + i, 9, 10], [-0.5, -0.25, -1.0], finish_reason="stop")
        samples.append(sample)
    return samples


class SeesTheBatch:
    """An algorithm that checks, at each training hook, the batch against its declared form."""

    def __init__(self):
        self.calls: list[str] = []

    @hookimpl
    def slime_train_inputs(self, config, role):
        return ["log_probs", "ref_log_probs"]

    @hookimpl
    def slime_compute_advantages(self, config, role, batch):
        assert_conforms(batch, TrainBatch)
        self.calls.append("advantages")
        adv = [torch.full((n,), r) for r, n in zip(batch["rewards"], batch["response_lengths"])]
        return {"advantages": adv, "returns": adv}

    @hookimpl
    def slime_rollout_data_postprocess(self, config, rollout_id, batch):
        assert_conforms(batch, TrainBatch)
        assert {"advantages", "returns", "log_probs", "ref_log_probs", "rollout_log_probs"} <= set(batch)
        self.calls.append("postprocess")

    @hookimpl
    def slime_loss(self, config, role, batch, outputs, reducer):
        assert_conforms(batch, TrainBatch)
        assert_conforms(outputs, ModelOutputs)
        self.calls.append("loss")
        return reducer([-a * lp for a, lp in zip(batch["advantages"], outputs["log_probs"])]), {}


def test_every_stage_makes_the_form_it_declares(tiny_checkpoint):
    config = Config.make(hf_checkpoint=str(tiny_checkpoint), global_batch_size=2, micro_batch_size=1, lr=1e-4)
    columns = convert_samples(load_plugins([]), config, _samples())
    assert_conforms(columns, RolloutColumns)
    parts = split_rollout_data(config, columns, dp_size=2)
    for part in parts:
        assert_conforms(part, RankData)
    algorithm = SeesTheBatch()
    trainer = Trainer(config, load_plugins([], extra=[algorithm]), rank=0, world_size=1)
    trainer.train(0, split_rollout_data(config, columns, dp_size=1)[0])
    assert algorithm.calls[:2] == ["advantages", "postprocess"] and algorithm.calls.count("loss") == 4
