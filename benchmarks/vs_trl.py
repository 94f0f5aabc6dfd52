"""slime-core's GRPO step against Hugging Face TRL's ``GRPOTrainer`` on the same work, side by side.

    pip install -c .ci/constraints.txt -e '.[bench]'      # TRL, torch kept at the pinned CPU build
    python benchmarks/vs_trl.py --config tiny --repeat 2
    python benchmarks/vs_trl.py --config smollm2 --repeat 2

Both sides get the same local model (``smollm2``: the converted SmolLM2-135M-Instruct in
``~/.cache/slimecore/models/``; ``tiny``: the random Qwen2 of ``slimecore.testing.tiny``), the same prompt
file ("What is A + B? Answer with the number only.", A and B drawn from 0..99 with seed 0, chat template on),
the same reward (1 when the first integer of the answer is A + B), the same sampling (temperature 1, no
top-k/top-p), the same lr (constant), prompts x samples per step, new tokens and steps, fp32 and
``--threads`` torch threads. TRL runs as the issue describes it: ``use_vllm=False``, ``beta=0``,
``loss_type="dapo"``, ``num_iterations=1``, one optimizer step per generation batch (its whole batch in one
forward, ``gradient_checkpointing=False``); slime-core runs ``slime-core train --plugin grpo`` with the
token-mean loss that matches DAPO's (``--calculate-per-token-loss``) and one micro-batch of the same size.

The sides run alternately, ``--repeat`` times each, each in its own process. Before a side starts the
benchmark waits (at most ``--idle-wait`` seconds) for the 1-minute load average to fall under
``--idle-load``, and it records the load average before and after every side. The JSON written to
``benchmarks/results/vs_trl_<config>_<date>.json`` holds every run's per-step times and, per side, the
median step time over the steps after ``--warmup``; the ratio slime-core / TRL (< 1: slime-core is faster);
slime-core's step parts (rollout, train, weight sync and the rest, "overhead") and the time from the
command to its first rollout; TRL's generation share of its step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = {  # the work: identical on both sides
    "smollm2": {"prompts": 4, "samples": 4, "new_tokens": 32, "steps": 6, "lr": 1e-6},
    "tiny": {"prompts": 8, "samples": 8, "new_tokens": 16, "steps": 10, "lr": 1e-4},
}
QUESTION = "What is {a} + {b}? Answer with the number only."
FIRST_INT = re.compile(r"-?\d+")


def first_integer_reward(response: str, label) -> float:
    """1.0 when the first integer in the response equals the label."""
    found = FIRST_INT.search(response)
    return float(found is not None and int(found.group()) == int(label))


async def slime_reward(args, sample) -> float:
    """``--custom-rm-path vs_trl.slime_reward``: slime's reward-function signature."""
    return first_integer_reward(sample.response, sample.label)


def trl_reward(completions, label, **kwargs) -> list[float]:
    """TRL's reward-function signature (conversational completions)."""
    return [first_integer_reward(c[-1]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]


def write_prompts(path: Path, n: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"input": QUESTION.format(a=a, b=b), "label": str(a + b)}) + "\n")
    return path


def model_dir(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from slimecore.testing.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(workdir / "tiny")
    from slimecore.hf_checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)


# -- the slime-core side -----------------------------------------------------------------------------
def run_slime(work: dict, model: Path, prompts: Path, workdir: Path, threads: int) -> dict:
    log_dir = workdir / f"slime-{time.time_ns()}"
    batch = work["prompts"] * work["samples"]
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint", str(model),
            "--prompt-data", str(prompts), "--input-key", "input", "--label-key", "label", "--apply-chat-template",
            "--rollout-batch-size", str(work["prompts"]), "--n-samples-per-prompt", str(work["samples"]),
            "--rollout-max-response-len", str(work["new_tokens"]), "--num-rollout", str(work["steps"]),
            "--global-batch-size", str(batch), "--micro-batch-size", str(batch), "--lr", str(work["lr"]),
            "--calculate-per-token-loss", "--custom-rm-path", "vs_trl.slime_reward",
            "--cpu-threads-per-actor", str(threads), "--log-dir", str(log_dir), "--no-use-tensorboard",
            "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    start_wall, start = time.time(), time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"slime-core failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "perf/step_time" in s]
    parts = []
    for s in steps:
        rollout, train = s.get("perf/rollout_wait_time", 0.0), s.get("perf/actor_train_time", 0.0)
        sync = s.get("perf/update_weights_time", 0.0)
        parts.append({"step": s["perf/step_time"], "rollout": rollout, "train": train, "weight_sync": sync,
                      "overhead": s["perf/step_time"] - rollout - train - sync,
                      "reward": s.get("rollout/raw_reward")})
    return {"wall": wall, "steps": parts,
            "command_to_first_rollout": steps[0]["timeline/rollout_start"] - start_wall}


# -- the TRL side (runs in its own process: ``--trl-worker spec.json``) --------------------------------
def trl_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work, threads = spec["work"], spec["threads"]
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["input"]}], "label": r["label"]}
                                 for r in rows])
    batch = work["prompts"] * work["samples"]
    config = GRPOConfig(output_dir=spec["output_dir"], use_cpu=True, bf16=False, fp16=False, use_vllm=False, beta=0.0,
                        loss_type="dapo", num_iterations=1, learning_rate=work["lr"], lr_scheduler_type="constant",
                        num_generations=work["samples"], per_device_train_batch_size=batch,
                        gradient_accumulation_steps=1, steps_per_generation=1,
                        max_completion_length=work["new_tokens"], max_steps=work["steps"], temperature=1.0,
                        top_p=1.0, top_k=0, gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                        report_to="none", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    steps: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.generate = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step": time.perf_counter() - self.start, "generate": timer.generate})
            timer.generate = 0.0

    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    timer = _GenerateTimer(trainer)
    trainer.train()
    rewards = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    for s, r in zip(steps, rewards):
        s["reward"] = r
    Path(spec["result"]).write_text(json.dumps({"steps": steps}))


class _GenerateTimer:
    """Times TRL's ``model.generate`` calls inside the trainer (its rollout share of a step)."""

    def __init__(self, trainer):
        self.generate = 0.0
        model = trainer.model
        original = model.generate

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.generate += time.perf_counter() - start

        model.generate = timed


def run_trl(work: dict, model: Path, prompts: Path, workdir: Path, threads: int) -> dict:
    spec = workdir / f"trl-{time.time_ns()}.json"
    result = spec.with_suffix(".result.json")
    spec.write_text(json.dumps({"work": work, "model": str(model), "prompts": str(prompts), "threads": threads,
                                "output_dir": str(workdir / "trl-out"), "result": str(result)}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", str(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        raise SystemExit(f"TRL failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {"wall": time.perf_counter() - start, **json.loads(result.read_text())}


# -- the comparison ----------------------------------------------------------------------------------
def wait_for_idle(load: float, bound: float) -> float:
    """Wait up to ``bound`` seconds for the 1-minute load average to drop under ``load``; returns the wait."""
    start = time.monotonic()
    while os.getloadavg()[0] >= load and time.monotonic() - start < bound:
        time.sleep(5)
    return time.monotonic() - start


def median_of(runs: list[dict], key: str, warmup: int) -> float:
    return statistics.median(s[key] for run in runs for s in run["steps"][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument("--steps", type=int, default=None, help="steps per run on both sides (default: the config's)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of every run left out of the medians")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--idle-load", type=float, default=1.0, help="wait for a 1-min load average under this")
    parser.add_argument("--idle-wait", type=float, default=60, help="at most this many seconds per side")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/vs_trl_<config>_<date>.json")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    for key, value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    import trl

    work = {**CONFIGS[args.config], **({"steps": args.steps} if args.steps else {})}
    sides = {"trl": run_trl, "slime-core": run_slime}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = model_dir(args.config, workdir)
        prompts = write_prompts(workdir / "prompts.jsonl", work["prompts"] * work["steps"] * 4)
        for i in range(args.repeat):
            for name, run in (sides.items() if i % 2 == 0 else reversed(sides.items())):
                waited = wait_for_idle(args.idle_load, args.idle_wait)
                load_before = os.getloadavg()
                result = run(work, model, prompts, workdir, args.threads)
                result.update(round=i, waited_for_idle=waited, load_before=load_before, load_after=os.getloadavg())
                runs[name].append(result)
                print(f"round {i} {name}: median step {statistics.median(s['step'] for s in result['steps'][args.warmup:]):.2f} s, "
                      f"load {load_before[0]:.1f} -> {result['load_after'][0]:.1f}", file=sys.stderr)

    trl_step, slime_step = median_of(runs["trl"], "step", args.warmup), median_of(runs["slime-core"], "step", args.warmup)
    slime = runs["slime-core"]
    summary = {
        "trl": {"median_step": trl_step, "median_generate": median_of(runs["trl"], "generate", args.warmup),
                "median_step_per_run": [statistics.median(s["step"] for s in r["steps"][args.warmup:])
                                        for r in runs["trl"]]},
        "slime-core": {"median_step": slime_step,
                       "median_step_per_run": [statistics.median(s["step"] for s in r["steps"][args.warmup:])
                                               for r in slime],
                       "parts": {k: median_of(slime, k, args.warmup)
                                 for k in ("rollout", "train", "weight_sync", "overhead")},
                       "command_to_first_rollout": statistics.median(r["command_to_first_rollout"] for r in slime)},
        "ratio_slime_over_trl": slime_step / trl_step,
    }
    summary["slime-core"]["weight_sync_share"] = summary["slime-core"]["parts"]["weight_sync"] / slime_step
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or HERE / "results" / f"vs_trl_{args.config}_{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    out.write_text(json.dumps({
        "config": args.config, "work": work, "repeat": args.repeat, "warmup": args.warmup, "threads": args.threads,
        "date": date.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "summary": summary, "runs": runs}, indent=1))
    s = summary["slime-core"]
    print(f"TRL median step {trl_step:.2f} s (generate {summary['trl']['median_generate']:.2f} s); slime-core "
          f"{slime_step:.2f} s = {summary['ratio_slime_over_trl']:.2f}x TRL's; parts: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in s["parts"].items())
          + f"; weight sync {100 * s['weight_sync_share']:.1f}% of the step; command -> first rollout "
          f"{s['command_to_first_rollout']:.1f} s\nwritten to {out}")


if __name__ == "__main__":
    main()
