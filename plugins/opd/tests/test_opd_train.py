"""End to end: ``slime-core train --plugin grpo --plugin opd --opd-only`` distils a tiny student toward a different
tiny teacher the run starts itself, or toward two teachers routed by each prompt's metadata, or toward a teacher in the
trainer (``--opd-teacher-load``), through the whole loop
(Ray, router, embedded engines, fsdp trainer): the student's sampled-token reverse KL (``train/opd_reverse_kl``, and
``rollout/opd_reverse_kl/<teacher>`` on each teacher's samples) falls, and so does the exact KL of its next-token
distribution to each teacher's on that teacher's prompts (computed here with transformers). Routing to external
teachers is tested in ``test_opd.py`` on a real engine."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from slimecore.testing import timeout as scaled
from slimecore.testing.tiny import build_tokenizer, make_tiny_checkpoint, teach_tiny

STEPS = 30


def _prompt(a: int, teacher: str = "a") -> list[dict]:
    if teacher == "b":
        return [{"role": "user", "content": f"Say yes to the {'apple river stone cloud tiger'.split()[a % 5]}."}]
    return [{"role": "user", "content": f"Which number is larger: {a} or {99 - a}?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random student; two teachers taught from it (a few steps, so they differ but overlap): ``a`` answers
    "which number is larger" with the number, ``b`` answers "say yes to ..." with "yes yes"; the prompts of both
    kinds alternate, each routed to its teacher."""
    root = tmp_path_factory.mktemp("opd")
    student = make_tiny_checkpoint(root / "student", seed=0)
    tok = build_tokenizer()

    def rows(answer, teacher):
        out = []
        for a in range(0, 60, 7):
            prompt = tok(tok.apply_chat_template(_prompt(a, teacher), tokenize=False,
                                                 add_generation_prompt=True))["input_ids"]
            ids = tok(answer(a))["input_ids"]
            out.append((prompt + ids, [False] * len(prompt) + [True] * len(ids)))
        return out

    teachers = {"a": teach_tiny(student, root / "a", rows(lambda a: f"{max(a, 99 - a)}<|im_end|>", "a"), steps=14,
                                lr=3e-3),
                "b": teach_tiny(student, root / "b", rows(lambda a: "yes yes<|im_end|>", "b"), steps=14, lr=3e-3)}
    prompts = {}
    for kinds in ("a", "ab"):  # "which number" prompts only; both kinds
        prompts[kinds] = root / f"prompts_{kinds}.jsonl"
        with prompts[kinds].open("w") as f:
            for i, a in enumerate(range(0, 99, 3)):
                teacher = "ab"[i % 2]
                f.write(json.dumps({"input": _prompt(a, teacher if kinds == "ab" else "a"),
                                    "label": str(max(a, 99 - a)),
                                    "metadata": {"rm_type": "compare", "opd_teacher": teacher}}) + "\n")
    return student, teachers, prompts


def _kl_per_teacher(student_dir, teachers: dict, prompts) -> dict[str, float]:
    """Mean exact KL(student || teacher) of the first response token over the prompts routed to each teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    out: dict[str, list[float]] = {name: [] for name in teachers}
    with torch.no_grad():
        for name, teacher_dir in teachers.items():
            teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
            for line in prompts.read_text().splitlines():
                row = json.loads(line)
                if len(teachers) > 1 and row["metadata"]["opd_teacher"] != name:
                    continue
                text = tok.apply_chat_template(row["input"], tokenize=False, add_generation_prompt=True)
                ids = torch.tensor([tok(text)["input_ids"]])
                s = torch.log_softmax(student(ids).logits[0, -1], -1)
                t = torch.log_softmax(teacher(ids).logits[0, -1], -1)
                out[name].append(float((s.exp() * (s - t)).sum()))
    return {name: statistics.fmean(v) for name, v in out.items()}


def _train(student, prompts, log_dir, *teacher_args, extra=()) -> list[dict]:
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "opd", *teacher_args,
            "--opd-only", "--hf-checkpoint", str(student), "--prompt-data", str(prompts), "--label-key", "label",
            "--apply-chat-template", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--lr", "1e-2", "--num-rollout", str(STEPS), "--log-dir",
            str(log_dir), "--no-use-tensorboard", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=scaled(500))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_distilled(steps, student, final, teachers, prompts, metric_names):
    """The logged reverse KL falls, over all samples and on each teacher's routed samples
    (``rollout/opd_reverse_kl/<teacher>``, for the teachers ``metric_names`` names), and so does the exact next-token
    KL to each teacher on its prompts."""
    assert all(m["rollout/opd_teacher_failures"] == 0 for m in steps)
    for key in ["train/opd_reverse_kl", *(f"rollout/opd_reverse_kl/{metric_names[name]}" for name in metric_names)]:
        kl = [m[key] for m in steps]
        first, last = statistics.fmean(kl[:4]), statistics.fmean(kl[-4:])
        assert last < 0.6 * first, (key, [round(x, 3) for x in kl])
    before, after = _kl_per_teacher(student, teachers, prompts), _kl_per_teacher(final, teachers, prompts)
    for name in teachers:
        assert after[name] < 0.7 * before[name], (name, before, after)


@pytest.mark.parametrize("routed", ["one teacher", "two routed teachers", "the trainer's teacher"])
def test_student_moves_toward_its_teachers(models, tmp_path, routed):
    """One teacher (a bare path: the ``default`` teacher) on "which number" prompts, or teachers ``a`` and ``b``
    routed by each row's ``metadata["opd_teacher"]`` over both kinds of prompts, 8 prompts a step (4 per teacher),
    or teacher ``a`` in the trainer (``--opd-teacher-load``: no teacher engine; no per-teacher rollout metric).
    With 4 a step at this learning rate, teacher a's larger pull on the shared tiny student first raised its KL to b
    on b's prompts (b 0.47 -> 0.83 while a fell, over ~60 steps, before both fell): the flat mean of an earlier
    30-step run, not a routing fault."""
    student, teachers, prompts = models
    if routed == "one teacher":
        steps = _train(student, prompts["a"], tmp_path / "run", "--opd-teacher", str(teachers["a"]))
        _assert_distilled(steps, student, tmp_path / "run" / "final", {"a": teachers["a"]}, prompts["a"],
                          {"a": "default"})
    elif routed == "the trainer's teacher":
        steps = _train(student, prompts["a"], tmp_path / "run", "--opd-teacher-load", str(teachers["a"]))
        assert not any(key.startswith("rollout/opd_reverse_kl/") for m in steps for key in m)
        _assert_distilled(steps, student, tmp_path / "run" / "final", {"a": teachers["a"]}, prompts["a"], {})
    else:
        steps = _train(student, prompts["ab"], tmp_path / "run", "--opd-teacher", f"a={teachers['a']}",
                       f"b={teachers['b']}", extra=["--rollout-batch-size", "8"])
        _assert_distilled(steps, student, tmp_path / "run" / "final", teachers, prompts["ab"], {"a": "a", "b": "b"})
