"""``slime_scoring_weights``: a plugin names ``{column: checkpoint}`` and the trainer fills the column with that
checkpoint's log-probs in its no-grad pass, before ``slime_compute_advantages``, from a CPU copy swapped into the
policy's model (as the reference policy's): the column equals the checkpoint's own log-probs computed with
transformers, the reference still scores as before beside it, and the policy's weights are untouched by the pass.
On fsdp here, on megatron under the CPU shim of tests/megatron (``tests/megatron/scoring_checks.py``)."""

from __future__ import annotations

import copy
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from slimecore import hookimpl
from slimecore.config import Config, ConfigError
from slimecore.errors import PluginError
from slimecore.plugins import load_plugins
from slimecore.trainers.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent / "megatron"))
import megatron_checks  # noqa: E402  (no megatron import at module level)
import scoring_checks  # noqa: E402


@pytest.fixture(scope="module")
def student_and_teacher(tmp_path_factory):
    """Two tiny Qwen3 checkpoints of one shape and different weights."""
    from slimecore.testing.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("scoring")
    return make_tiny_checkpoint(root / "student", "qwen3", seed=0), make_tiny_checkpoint(root / "teacher", "qwen3",
                                                                                         seed=1)


def _max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def test_fsdp_fills_the_column_with_the_checkpoints_log_probs(student_and_teacher):
    """fp32 to 1e-5 against transformers, before and after an optimizer step (the swap leaves nothing behind); the
    reference (initial weights) beside it; the student's weights exactly as they were after the no-grad pass."""
    student, teacher = student_and_teacher
    plugin = scoring_checks.Recorder(str(teacher))
    config = Config.make(hf_checkpoint=str(student), lr=1e-2, rollout_temperature=0.7)
    trainer = Trainer(config, load_plugins([], extra=[plugin], defaults=False), backend="fsdp")
    data = megatron_checks.rank_part(megatron_checks.synthetic_batch(), 1, 0)
    before = {k: p.detach().clone() for k, p in trainer.backend.model.named_parameters()}
    trainer.train(0, copy.deepcopy(data), update=False)
    after = dict(trainer.backend.model.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)
    teacher_hf, _ = megatron_checks.hf_response_log_probs(str(teacher), data, 0.7)
    student_hf, _ = megatron_checks.hf_response_log_probs(str(student), data, 0.7)
    [batch] = plugin.seen
    assert _max_diff(batch["teacher_log_probs"], teacher_hf) < 1e-5
    assert _max_diff(batch["ref_log_probs"], student_hf) < 1e-5
    assert _max_diff(batch["log_probs"], student_hf) < 1e-5
    assert _max_diff(teacher_hf, student_hf) > 0.05  # the two checkpoints differ

    trainer.train(1, copy.deepcopy(data))  # an optimizer step moves the student ...
    trainer.train(2, copy.deepcopy(data), update=False)
    moved = plugin.seen[-1]
    assert _max_diff(moved["log_probs"], student_hf) > 1e-3
    assert _max_diff(moved["teacher_log_probs"], teacher_hf) < 1e-5  # ... not the teacher
    assert _max_diff(moved["ref_log_probs"], student_hf) < 1e-5  # nor the reference


def test_fsdp2_ranks_keep_their_shards_of_the_checkpoint(student_and_teacher):
    """Two FSDP2 ranks (gloo): the checkpoint is read collectively into each rank's shards; each rank's column equals
    transformers' log-probs of its own samples."""
    from slimecore.testing.distributed import run_ranks

    student, teacher = student_and_teacher
    for r in run_ranks(scoring_checks.fsdp_sharded_scoring, str(student), str(teacher), world=2, timeout=300):
        assert r["sharded"] and r["student_unchanged"], r
        assert r["teacher_vs_hf"] < 1e-5 and r["reference_vs_hf"] < 1e-5, r


def test_columns_the_trainer_fills_or_two_plugins_name_are_refused(student_and_teacher):
    student, teacher = student_and_teacher
    config = Config.make(hf_checkpoint=str(student))

    class Other:
        def __init__(self, column, name="other"):
            self.column, self.__name__ = column, name  # the plugin's name

        @hookimpl
        def slime_scoring_weights(self, config, role):
            return {self.column: str(teacher)}

    for extra, message in (([Other("ref_log_probs")], "names column 'ref_log_probs', which the trainer fills"),
                           ([Other("t", "a"), Other("t", "b")],
                            "plugins 'b' and 'a' both ask slime_scoring_weights for column 't'")):
        hooks = load_plugins([], extra=extra, defaults=False)
        with pytest.raises(PluginError, match=message):
            hooks.slime_scoring_weights(config=config, role="actor")


def test_a_checkpoint_of_another_architecture_is_refused_before_ray(student_and_teacher, tmp_path):
    from slimecore.testing.tiny import make_tiny_checkpoint
    from slimecore.trainers.backend import check_scoring_weights

    student, _ = student_and_teacher
    wider = make_tiny_checkpoint(tmp_path / "wider", "qwen3", hidden=96, seed=2)
    hooks = load_plugins([], extra=[scoring_checks.Recorder(str(wider))], defaults=False)
    with pytest.raises(ConfigError, match=r"the teacher_log_probs checkpoint \(slime_scoring_weights\) .* is not of "
                                          r"the policy's architecture .*: hidden_size 96 \(the policy's 64\)"):
        check_scoring_weights(Config.make(hf_checkpoint=str(student)), hooks)
    hooks = load_plugins([], extra=[scoring_checks.Recorder(str(tmp_path))], defaults=False)
    with pytest.raises(ConfigError, match="not an HF checkpoint directory"):
        check_scoring_weights(Config.make(hf_checkpoint=str(student)), hooks)


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_models")),
                    reason="needs megatron-core, mbridge and the models plugin")
def test_megatron_fills_the_column_with_the_checkpoints_log_probs(student_and_teacher, tmp_path):
    """The same on the megatron backend (CPU shim), with the teacher as an HF directory, a torch_dist one and a
    Megatron-LM checkpoint root (slime's tools/convert_hf_to_torch_dist.py: a ``release`` one), the reference by
    ``--ref-load`` of another Megatron-LM root (``iter_0000003``, the tracker's) holding the teacher's weights;
    a Megatron-LM checkpoint of another architecture or size is one line naming the flag, keys and cause; `convert
    megatron-to-hf --load ROOT` writes the teacher's HF weights back exactly."""
    from slimecore.testing.distributed import run_ranks

    student, teacher = student_and_teacher
    [r] = run_ranks(scoring_checks.megatron_scoring, str(student), str(teacher), str(tmp_path / "teacher_dist"),
                    world=1, timeout=300)
    for source in ("hf", "torch_dist", "megatron_lm"):
        got = r[source]
        assert got["teacher_vs_hf"] < 1e-5 and got["reference_vs_hf"] < 1e-5 and got["policy_vs_hf"] < 1e-5, r
        assert got["student_unchanged"] and got["teacher_vs_student"] > 0.05, r
    architecture, size = r.get("architecture_refusal", ""), r.get("size_refusal", "")
    assert "\n" not in architecture + size, r
    assert architecture.startswith(f"--ref-load {tmp_path / 'no_qk'}: the checkpoint {tmp_path / 'no_qk'}/iter_0000003 "
                                   "does not match the model: missing from it: "
                                   "decoder.layers.self_attention.k_layernorm.weight, "
                                   "decoder.layers.self_attention.q_layernorm.weight. Likely cause: it was saved for "
                                   "another architecture"), architecture
    assert size.startswith(f"--ref-load {tmp_path / 'wider'}: the checkpoint"), size
    assert "shapes differ: decoder.final_layernorm.weight (96,) in the checkpoint, (64,) in the model" in size, size
    assert "another model size" in size and "optimizer" not in architecture + size, r
    assert r["convert_exact"], r  # `slime-core convert megatron-to-hf --load ROOT`
    assert r["stepped_vs_student"] < 1e-5, r  # --ref-ckpt-step 3 read iter_0000003, not the tracker's iter_0000009


def test_megatron_lm_checkpoint_roots_are_recognised_or_refused_before_ray(student_and_teacher, tmp_path):
    """A Megatron-LM root (tracker -> iter_N or release, the folder holding metadata.json) or its folder given
    directly passes --ref-load's and --opd-teacher-load's check on megatron; a tracker naming a missing folder, a
    slime-core save root, and any of them on fsdp are one line naming the flag, the path and what to do."""
    from slimecore.checkpoint_layout import megatron_lm_checkpoint
    from slimecore.config import check_ref_load

    student, _ = student_and_teacher
    root, released, missing, ours = (tmp_path / n for n in ("root", "released", "missing", "ours"))
    for folder in (root / "iter_0000003", released / "release", ours / "iter_0000002" / "actor"):
        folder.mkdir(parents=True)
        (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    missing.mkdir()
    for directory, text in ((root, "3\n"), (released, "release"), (missing, "7"), (ours, "2")):
        (directory / "latest_checkpointed_iteration.txt").write_text(text)
    assert megatron_lm_checkpoint(root) == root / "iter_0000003"
    assert megatron_lm_checkpoint(released) == released / "release"
    assert megatron_lm_checkpoint(root / "iter_0000003") == root / "iter_0000003"
    assert megatron_lm_checkpoint(student) is None

    opd = {o.name: o.default for o in load_plugins(["opd"]).slime_options()["opd"]}

    def check(flag: str, backend: str, checkpoint, step=None) -> None:
        if flag == "--ref-load":
            check_ref_load(Config.make(hf_checkpoint=str(student), train_backend=backend, ref_load=str(checkpoint),
                                       ref_ckpt_step=step))
        else:
            values = opd | {"opd_teacher_load": str(checkpoint), "opd_teacher_ckpt_step": step}
            config = Config.make(plugins=["opd"], plugin_values={"opd": values}, hf_checkpoint=str(student),
                                 train_backend=backend)
            hooks = load_plugins(["opd"])
            hooks.slime_validate_config(config=config)
            assert hooks.slime_scoring_weights(config=config, role="actor") == {
                "teacher_log_probs": str(checkpoint if step is None else checkpoint / f"iter_{step:07d}")}

    for checkpoint, step in ((root, None), (released, None), (root / "iter_0000003", None), (missing, 3),
                             (root, 3)):
        if step == 3 and checkpoint == missing:  # a step picks its folder whatever the tracker names
            (missing / "iter_0000003").mkdir()
            (missing / "iter_0000003" / "metadata.json").write_text("{}")
        for flag in ("--ref-load", "--opd-teacher-load"):
            check(flag, "megatron", checkpoint, step)
    shutil.rmtree(missing / "iter_0000003")
    refusals = {
        ("megatron", missing): "a Megatron-LM checkpoint root whose latest_checkpointed_iteration.txt names "
                               "iter_0000007, which does not exist; point the tracker at a saved iteration",
        ("megatron", ours): "a slime-core checkpoint root (iter_0000002 holds a folder per role); give the role's "
                            f"folder, {ours / 'iter_0000002' / 'actor'}",
        ("fsdp", root): "a Megatron-LM checkpoint (iter_0000003), which --train-backend fsdp cannot read; convert it "
                        f"with `slime-core convert megatron-to-hf --load {root / 'iter_0000003'} --hf-checkpoint "
                        "HF_DIR --output OUT`",
        ("megatron", root, 5): "the step asked for is iter_0000005, which does not exist",
        ("megatron", student, 3): "the step asked for is iter_0000003, which does not exist",
    }
    for (backend, checkpoint, *step), message in refusals.items():
        for flag, step_flag in (("--ref-load", "--ref-ckpt-step"), ("--opd-teacher-load", "--opd-teacher-ckpt-step")):
            with pytest.raises(ConfigError) as info:
                check(flag, backend, checkpoint, *step)
            where = f"{flag} {checkpoint}" + (f" with {step_flag} {step[0]}" if step else "")
            assert "\n" not in str(info.value) and str(info.value).startswith(f"{where}: {message}"), str(info.value)


def test_a_checkpoint_step_without_its_checkpoint_is_refused(student_and_teacher):
    from slimecore.config import validate_core

    student, _ = student_and_teacher
    with pytest.raises(ConfigError, match=r"^--ref-ckpt-step picks an iteration of --ref-load's Megatron-LM checkpoint "
                                          r"root; give --ref-load ROOT too$"):
        validate_core(Config.make(hf_checkpoint=str(student), ref_ckpt_step=3, rollout_batch_size=2))
    opd = {o.name: o.default for o in load_plugins(["opd"]).slime_options()["opd"]}
    config = Config.make(plugins=["opd"], plugin_values={"opd": opd | {"opd_teacher_ckpt_step": 3,
                                                                       "opd_teacher_urls": ["default=http://x:1"]}},
                         hf_checkpoint=str(student))
    with pytest.raises(ConfigError, match=r"^--opd-teacher-ckpt-step picks an iteration of --opd-teacher-load's"):
        load_plugins(["opd"]).slime_validate_config(config=config)
