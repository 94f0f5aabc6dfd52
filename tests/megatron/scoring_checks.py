"""``slime_scoring_weights`` on the trainers: a test plugin that names a teacher checkpoint and records the batches
the advantages see (tests/test_scoring_weights.py), and the megatron check's body, run in a fresh spawned process
(``run_ranks``) with the CPU shim; its answers are plain numbers."""

from __future__ import annotations

import copy

import torch

from slimecore import hookimpl


class Recorder:
    """Asks for ``log_probs``, ``ref_log_probs`` and ``teacher_log_probs`` (``teacher``'s weights); advantage =
    reward; a plain policy-gradient loss. Keeps the batches ``slime_compute_advantages`` saw in ``seen``."""

    def __init__(self, teacher: str):
        self.teacher, self.seen = teacher, []

    @hookimpl
    def slime_scoring_weights(self, config, role):
        return {"teacher_log_probs": self.teacher}

    @hookimpl
    def slime_train_inputs(self, config, role):
        return ["log_probs", "ref_log_probs"]

    @hookimpl
    def slime_compute_advantages(self, config, role, batch):
        self.seen.append({k: v for k, v in batch.items() if k in ("log_probs", "ref_log_probs", "teacher_log_probs")})
        adv = [torch.full((n,), float(r)) for r, n in zip(batch["rewards"], batch["response_lengths"])]
        return {"advantages": adv, "returns": adv}

    @hookimpl
    def slime_loss(self, config, role, batch, outputs, reducer):
        pg = [-torch.exp(lp - old.detach()) * a for lp, old, a in zip(outputs["log_probs"], batch["log_probs"],
                                                                       batch["advantages"])]
        loss = reducer(pg)
        return loss, {"pg_loss": loss.detach()}


def megatron_scoring(rank: int, world: int, student: str, teacher: str, teacher_dist: str) -> dict:
    import megatron_checks

    megatron_checks._setup()
    from slimecore.convert import hf_to_megatron
    from slimecore.plugins import load_plugins
    from slimecore.trainers.trainer import Trainer

    data = megatron_checks.rank_part(megatron_checks.synthetic_batch(), 1, 0)
    teacher_hf, _ = megatron_checks.hf_response_log_probs(teacher, data, 0.7)
    student_hf, _ = megatron_checks.hf_response_log_probs(student, data, 0.7)
    out = {}
    for name, checkpoint in (("hf", teacher), ("torch_dist", teacher_dist)):
        if name == "torch_dist":
            hf_to_megatron(teacher, teacher_dist, megatron_checks._hooks())
        plugin = Recorder(checkpoint)
        config = megatron_checks.grpo_config(student, rollout_temperature=0.7)
        trainer = Trainer(config, load_plugins(["models"], extra=[plugin], defaults=False), rank=rank,
                          world_size=world, backend="megatron")
        before = {k: p.detach().clone() for k, p in trainer.backend.modules.named_parameters()}
        trainer.train(0, copy.deepcopy(data), update=False)
        after = dict(trainer.backend.modules.named_parameters())
        [batch] = plugin.seen
        out[name] = {"teacher_vs_hf": megatron_checks._max_diff(batch["teacher_log_probs"], teacher_hf),
                     "reference_vs_hf": megatron_checks._max_diff(batch["ref_log_probs"], student_hf),
                     "teacher_vs_student": megatron_checks._max_diff(teacher_hf, student_hf),
                     "student_unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    return out


def fsdp_sharded_scoring(rank: int, world: int, student: str, teacher: str) -> dict:
    """FSDP2 (``shard=True``) over ``world`` gloo ranks: each rank keeps its shards of the teacher (read collectively)
    and scores its own samples; plain numbers for the test."""
    import megatron_checks

    from slimecore.config import Config
    from slimecore.plugins import load_plugins
    from slimecore.trainers.fsdp import _local
    from slimecore.trainers.trainer import Trainer

    data = megatron_checks.rank_part(megatron_checks.synthetic_batch(), world, rank)
    teacher_hf, _ = megatron_checks.hf_response_log_probs(teacher, data, 0.7)
    student_hf, _ = megatron_checks.hf_response_log_probs(student, data, 0.7)
    plugin = Recorder(teacher)
    config = Config.make(hf_checkpoint=student, rollout_temperature=0.7)
    trainer = Trainer(config, load_plugins([], extra=[plugin], defaults=False), rank=rank, world_size=world,
                      backend="fsdp", shard=True)
    before = {k: _local(p).detach().clone() for k, p in trainer.backend.model.named_parameters()}
    trainer.train(0, copy.deepcopy(data), update=False)
    [batch] = plugin.seen
    return {"sharded": trainer.backend.sharded,
            "teacher_vs_hf": megatron_checks._max_diff(batch["teacher_log_probs"], teacher_hf),
            "reference_vs_hf": megatron_checks._max_diff(batch["ref_log_probs"], student_hf),
            "student_unchanged": all(torch.equal(before[k], _local(p)) for k, p in
                                     trainer.backend.model.named_parameters())}
