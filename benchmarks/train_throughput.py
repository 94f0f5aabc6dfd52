"""Training throughput of one backend on synthetic GRPO batches: trained tokens/s, model TFLOP/s per device and
MFU, no engine and no Ray (the trainer alone, as each train actor runs it).

    python benchmarks/train_throughput.py --shape qwen2.5-0.5B --backend fsdp -- --bf16
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --shape qwen2.5-0.5B --backend megatron \\
        -- --bf16 --tensor-model-parallel-size 2 --use-dynamic-batch-size --max-tokens-per-gpu 16384

Everything after ``--`` is a ``slime-core train`` flag (``--bf16``, the Megatron parallel sizes, micro-batching,
``--lr`` ...). ``--shape`` builds a randomly initialised model locally (nothing is downloaded): ``tiny`` (the test
model), ``qwen2.5-0.5B`` (Qwen2.5-0.5B's config: 24 layers, hidden 896, 14/2 heads, FFN 4864, vocab 151936,
tied embeddings) or ``qwen2.5-1.5B`` (28 layers, hidden 1536, 12/2 heads, FFN 8960), on the GPU when there is
one; ``--hf-checkpoint DIR`` uses a local checkpoint instead. Each step trains ``--samples`` samples of
``--prompt-len`` + ``--response-len`` tokens with the grpo plugin's loss (groups of ``--group`` sharing a prompt,
normalised rewards +-1) as one optimizer step.

Figures (medians over the steps after ``--warmup``): ``perf/actor_train_tok_per_s`` (all ranks),
``perf/actor_train_tflops`` (model FLOPs per device, ``slimecore.trainers.flops``: causal attention, the output
head on response tokens only, recompute not counted), MFU = TFLOP/s / the device's peak (``--peak-tflops``, or the
dense bf16 peak of a known GPU with ``--bf16``), and the peak GPU memory. Written to ``--out`` as JSON by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, by device-name substring.
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "H20": 148.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "B200": 2250.0}
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
QWEN25_15B = {**QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12}  # Qwen2.5-1.5B: 2 KV heads and tied embeddings too
SHAPES = {"qwen2.5-0.5B": QWEN25_05B, "qwen2.5-1.5B": QWEN25_15B}


def build_checkpoint(shape: str, directory: Path) -> Path:
    """A randomly initialised checkpoint of ``shape`` in ``directory`` (bf16 safetensors: half the disk)."""
    if shape == "tiny":
        from slimecore.testing.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(directory)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 1.5B random init takes a minute on a CPU
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def synthetic_batch(samples: int, group: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> dict:
    """Rollout columns as the rollout manager makes them: groups of ``group`` sharing a prompt, advantages +-1."""
    rng = random.Random(seed)
    data: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards",
                                             "rollout_ids", "sample_indices", "truncated")}
    prompt: list[int] = []
    for i in range(samples):
        if i % group == 0:
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        data["tokens"].append(prompt + [rng.randrange(vocab) for _ in range(response_len)])
        data["response_lengths"].append(response_len)
        data["loss_masks"].append([1] * response_len)
        data["rewards"].append(1.0 if i % 2 else -1.0)  # already group-normalised: mean 0 in every group
        data["raw_rewards"].append(float(i % 2))
        data["rollout_ids"].append(i)
        data["sample_indices"].append(i)
        data["truncated"].append(0)
    return data


def measure(args: argparse.Namespace, train_argv: list[str]) -> dict:
    """Build the trainer for this rank and time ``args.steps`` training calls; every rank returns the figures."""
    import torch
    import torch.distributed as dist

    from slimecore.config import parse_config
    from slimecore.plugins import load_plugins
    from slimecore.rollout.schedule import split_rollout_data

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():  # under torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    plugins = ["grpo"] + (["models"] if args.backend == "megatron" else [])
    hooks = load_plugins(plugins)
    # a --prompt-data value keeps a built-in task's quick-start settings out of this config (no file is read)
    argv = ["--hf-checkpoint", str(args.hf_checkpoint), "--train-backend", args.backend, "--prompt-data", "synthetic",
            "--rollout-batch-size", str(args.samples // args.group), "--n-samples-per-prompt", str(args.group),
            "--global-batch-size", str(args.samples), "--actor-num-gpus-per-node", str(world), *train_argv]
    config = parse_config(argv, plugins, hooks.slime_options(), hooks.slime_implied_options())
    hooks.slime_validate_config(config=config)
    from slimecore.trainers.trainer import Trainer

    trainer = Trainer(config, hooks, rank=rank, world_size=world)  # the --train-backend backend
    dp_rank, dp_size = rank, world
    if args.backend == "megatron":
        from slimecore.trainers.megatron import data_parallel_rank

        dp_rank, dp_size = data_parallel_rank(config, rank, world), trainer.backend.dp_size
    vocab = trainer.backend.hf_config.vocab_size
    per_step = []
    for step in range(args.steps):
        data = synthetic_batch(args.samples, args.group, args.prompt_len, args.response_len, vocab, seed=step)
        part = split_rollout_data(config, data, dp_size)[dp_rank]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train(step, part)
        if cuda:
            torch.cuda.synchronize()
        metrics["wall_s"] = time.perf_counter() - start
        per_step.append(metrics)
        if rank == 0:
            print(f"step {step}: {metrics['wall_s']:.2f} s, {metrics['perf/actor_train_tok_per_s']:.0f} tok/s, "
                  f"{metrics['perf/actor_train_tflops']:.3f} TFLOP/s per device", file=sys.stderr)
    if args.compare_fsdp:
        summary_diff = logprob_diff_to_fsdp(trainer, config, hooks, part)
    kept = per_step[args.warmup:] or per_step
    summary = {key: statistics.median(m[key] for m in kept)
               for key in ("perf/actor_train_tok_per_s", "perf/actor_train_tflops", "wall_s", "train/loss")}
    device = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    peak = args.peak_tflops or (next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device), None)
                                if cuda and config.bf16 else None)
    if peak:
        summary["mfu"] = summary["perf/actor_train_tflops"] / peak
    if cuda:
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.compare_fsdp:
        summary.update(summary_diff)
    return {"backend": args.backend, "shape": args.shape, "device": device, "world_size": world,
            "peak_tflops": peak, "train_args": train_argv, "samples": args.samples, "group": args.group,
            "prompt_len": args.prompt_len, "response_len": args.response_len, "steps": args.steps,
            "warmup": args.warmup, "summary": summary, "per_step": per_step}


def logprob_diff_to_fsdp(trainer, config, hooks, part: dict) -> dict[str, float]:
    """Log-probs of the last step's samples from this (trained) megatron model and from the fsdp backend holding
    the same weights, in the same precision: the mean and largest absolute difference."""
    import torch

    from slimecore.trainers.trainer import Trainer

    weights = trainer.backend.named_weights()  # HF names, gathered
    reference = Trainer(config, hooks, backend="fsdp")
    result = reference.backend.model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(reference.backend.hf_config, "tie_word_embeddings", False) else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(f"the megatron export does not match the HF model: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    ours, theirs = trainer.compute_log_probs(part), reference.compute_log_probs(part)
    diffs = torch.cat([(a.float() - b.float()).abs().cpu() for a, b in zip(ours, theirs)])
    return {"logprob_abs_diff_mean": float(diffs.mean()), "logprob_abs_diff_max": float(diffs.max())}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    parser.add_argument("--shape", choices=("tiny", *SHAPES), default="qwen2.5-0.5B")
    parser.add_argument("--hf-checkpoint", default=None, help="a local HF checkpoint instead of --shape")
    parser.add_argument("--samples", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known GPUs)")
    parser.add_argument("--compare-fsdp", action="store_true",
                        help="megatron, one process: also the log-prob difference to the fsdp backend on the same "
                             "weights and precision (the bf16 numerics check)")
    parser.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = parser.parse_args(own)
    if args.compare_fsdp and args.backend != "megatron":
        parser.error("--compare-fsdp compares the megatron backend with fsdp: add --backend megatron")
    if args.samples % args.group:
        parser.error("--samples must be a multiple of --group")
    return args, train_argv


def main() -> None:
    args, train_argv = parse_args(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        if args.hf_checkpoint is None:
            # every rank builds the same seeded model in its own temp dir (no shared file system assumed)
            args.hf_checkpoint = build_checkpoint(args.shape, Path(tmp) / "model")
        else:
            args.shape = None
        result = measure(args, train_argv)
    if int(os.environ.get("RANK", 0)) == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps(result["summary"], indent=1))
        print(f"written to {out}")


if __name__ == "__main__":
    main()
