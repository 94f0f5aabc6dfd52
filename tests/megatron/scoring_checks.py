"""``slime_scoring_weights`` on the trainers: a test plugin that names a teacher checkpoint and records the batches
the advantages see (tests/test_scoring_weights.py), and the megatron check's body, run in a fresh spawned process
(``run_ranks``) with the CPU shim; its answers are plain numbers."""

from __future__ import annotations

import copy
from pathlib import Path

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


def write_megatron_lm(hf_dir: str, root: str, iteration: int = 3, mutate=None) -> Path:
    """A Megatron-LM checkpoint root of ``hf_dir``'s weights, laid out as Megatron-LM's save_checkpoint does (slime's
    tools/convert_hf_to_torch_dist.py): ``dist_checkpointing.save`` of ``{"model": sharded state, "iteration",
    "checkpoint_version": 3.0, "args"}`` (an optimizer tensor beside it, as a training save has) with Megatron-LM's
    content metadata into ``iter_{iteration:07d}/``, and the tracker naming ``iteration``. ``mutate(model_state)``
    changes the sharded model state before the save (a mismatching checkpoint). Returns the iteration folder."""
    import argparse

    import megatron_checks
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from slimecore.convert import _parallel_config
    from slimecore.trainers.megatron_model import BridgedModel, init_parallel, unwrap

    config = _parallel_config(Path(hf_dir), 1, 1, 1)
    init_parallel(config)
    model = BridgedModel.build(config, megatron_checks._hooks(), hf_dir)
    sharded = unwrap(model.chunks[0]).sharded_state_dict()
    if mutate is not None:
        mutate(sharded)
    embedding = unwrap(model.chunks[0]).embedding.word_embeddings.weight
    folder = Path(root) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    state = {"model": sharded, "iteration": iteration, "checkpoint_version": 3.0,
             "args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                        hidden_size=embedding.shape[1], iteration=iteration, ckpt_format="torch_dist"),
             "optimizer": {"state": {"exp_avg": ShardedTensor.from_rank_offsets(
                 "optimizer.state.exp_avg.embedding.word_embeddings.weight", torch.ones_like(embedding.detach()),
                 replica_id=0)}}}
    dist_checkpointing.save(state, str(folder), content_metadata={
        "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "dp_reshardable"})
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def megatron_lm_root(rank: int, world: int, hf_dir: str, root: str) -> str:
    """``write_megatron_lm`` in a fresh process (``run_ranks``) with the CPU shim: a Megatron-LM root of ``hf_dir``."""
    import megatron_checks

    megatron_checks._setup()
    return str(write_megatron_lm(hf_dir, root))


def without_qk_norm(sharded: dict) -> None:
    """A checkpoint of an architecture without qk-norm (Llama, Qwen2) for the Qwen3 model."""
    for key in [k for k in sharded if "q_layernorm" in k or "k_layernorm" in k]:
        del sharded[key]


def megatron_scoring(rank: int, world: int, student: str, teacher: str, teacher_dist: str) -> dict:
    """The teacher column (and for "megatron_lm" the reference, by --ref-load) from an HF directory, a torch_dist one
    and Megatron-LM checkpoint roots (``write_megatron_lm``: the tracker's iteration for --ref-load, a ``release``
    one for the teacher); then the one-line refusals of a checkpoint of another architecture (no qk-norm) and of
    another size; --ref-ckpt-step's iteration read in place of the tracker's; ``convert megatron-to-hf`` of the
    release root gives the teacher's HF weights back."""
    import shutil

    import megatron_checks

    megatron_checks._setup()
    from slimecore.convert import hf_to_megatron
    from slimecore.plugins import load_plugins
    from slimecore.trainers.megatron_model import MegatronSetupError
    from slimecore.trainers.trainer import Trainer

    data = megatron_checks.rank_part(megatron_checks.synthetic_batch(), 1, 0)
    teacher_hf, _ = megatron_checks.hf_response_log_probs(teacher, data, 0.7)
    student_hf, _ = megatron_checks.hf_response_log_probs(student, data, 0.7)
    base = Path(teacher_dist).parent
    out = {}
    for name, checkpoint in (("hf", teacher), ("torch_dist", teacher_dist), ("megatron_lm", str(base / "released"))):
        core = {}
        if name == "torch_dist":
            hf_to_megatron(teacher, teacher_dist, megatron_checks._hooks())
        if name == "megatron_lm":
            iteration = write_megatron_lm(teacher, str(base / "mlm"))
            (base / "released").mkdir()
            shutil.copytree(iteration, base / "released" / "release")
            (base / "released" / "latest_checkpointed_iteration.txt").write_text("release")
            core["ref_load"] = str(base / "mlm")  # the reference, and the starting weights: the teacher's
        plugin = Recorder(checkpoint)
        config = megatron_checks.grpo_config(student, rollout_temperature=0.7, **core)
        trainer = Trainer(config, load_plugins(["models"], extra=[plugin], defaults=False), rank=rank,
                          world_size=world, backend="megatron")
        before = {k: p.detach().clone() for k, p in trainer.backend.modules.named_parameters()}
        trainer.train(0, copy.deepcopy(data), update=False)
        after = dict(trainer.backend.modules.named_parameters())
        [batch] = plugin.seen
        reference = teacher_hf if core else student_hf
        out[name] = {"teacher_vs_hf": megatron_checks._max_diff(batch["teacher_log_probs"], teacher_hf),
                     "reference_vs_hf": megatron_checks._max_diff(batch["ref_log_probs"], reference),
                     "policy_vs_hf": megatron_checks._max_diff(batch["log_probs"], reference),
                     "teacher_vs_student": megatron_checks._max_diff(teacher_hf, student_hf),
                     "student_unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    from slimecore.testing.tiny import make_tiny_checkpoint

    wider = make_tiny_checkpoint(base / "wider_hf", "qwen3", hidden=96, seed=2)
    for name, folder in (("architecture", write_megatron_lm(teacher, str(base / "no_qk"), mutate=without_qk_norm)),
                         ("size", write_megatron_lm(str(wider), str(base / "wider")))):
        try:
            trainer.backend.model.load_megatron_lm(folder, f"--ref-load {folder.parent}")
        except MegatronSetupError as exc:
            out[f"{name}_refusal"] = str(exc)
    # --ref-ckpt-step 3: iter_0000003 of a root whose tracker names a missing iteration (the student's weights)
    write_megatron_lm(student, str(base / "stepped"))
    (base / "stepped" / "latest_checkpointed_iteration.txt").write_text("9")
    trainer.backend._load_reference_checkpoint(megatron_checks._hooks(), base / "stepped", step=3)
    out["stepped_vs_student"] = megatron_checks._max_diff(trainer.compute_log_probs(copy.deepcopy(data)), student_hf)
    # `slime-core convert megatron-to-hf --load ROOT`: the teacher's HF weights back, exactly
    from safetensors.torch import load_file

    from slimecore.convert import megatron_to_hf

    megatron_to_hf(base / "released", teacher, base / "back", megatron_checks._hooks())
    original, back = load_file(f"{teacher}/model.safetensors"), load_file(f"{base}/back/model.safetensors")
    out["convert_exact"] = set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
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
