"""Peak memory and time of a micro-batch's response log-probs and entropies through the LM head, forward and
backward: the whole-vocabulary logits (the model's head, then ``ops.log_probs_and_entropy``) against the chunked
head with the chunk's logits recomputed in backward (``ops.linear_log_probs_and_entropy``).

    python benchmarks/head_logprobs.py                      # CPU: Qwen2.5-0.5B's head, 1024 tokens
    python benchmarks/head_logprobs.py --tokens 16384 --dtype bf16   # on a GPU

Each variant runs in a fresh process: the peak is the process's peak resident memory above what it held before
the forward (``ru_maxrss``) on the CPU, ``torch.cuda.max_memory_allocated`` above the inputs on CUDA. Written to
``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


def run_variant(variant: str, tokens: int, hidden: int, vocab: int, chunk: int, dtype: str) -> dict:
    import torch

    from slimecore.ops import linear_log_probs_and_entropy, log_probs_and_entropy

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device).mul_(0.02).requires_grad_()  # in place: no transient copy
    targets = torch.randint(0, vocab, (tokens,), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with autocast:
        if variant == "full":
            lp, ent = log_probs_and_entropy(torch.nn.functional.linear(h, w), targets, 1.0, True)
        else:
            lp, ent = linear_log_probs_and_entropy(h, w, targets, 1.0, True, chunk_size=chunk)
    (lp.sum() - 0.01 * ent.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": variant, "seconds": time.perf_counter() - start, "peak_bytes": peak,
            "checksum": float(lp.double().sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B: 896")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5: 151936")
    parser.add_argument("--chunk", type=int, default=None, help="default: slimecore.ops.linear_logprobs.CHUNK_TOKENS")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", default="benchmarks/results/head_logprobs.json")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunk is None:
        from slimecore.ops.linear_logprobs import CHUNK_TOKENS

        args.chunk = CHUNK_TOKENS
    if args.variant:  # the child process
        print(json.dumps(run_variant(args.variant, args.tokens, args.hidden, args.vocab, args.chunk, args.dtype)))
        return
    results = {}
    for variant in ("full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
                              "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--chunk", str(args.chunk),
                              "--dtype", args.dtype], check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    summary = {"device": device, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
               "chunk": args.chunk, "dtype": args.dtype, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **results,
               "peak_ratio": results["chunked"]["peak_bytes"] / max(results["full"]["peak_bytes"], 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    for variant in ("full", "chunked"):
        r = results[variant]
        print(f"{variant:8s} peak {r['peak_bytes'] / 2**20:8.0f} MiB  {r['seconds']:6.2f} s")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
