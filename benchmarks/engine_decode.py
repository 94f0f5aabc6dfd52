"""The embedded engine's decode speed against ``model.generate()`` on the same batch, model and length.

    python benchmarks/engine_decode.py --model smollm2 --batch 16 --new-tokens 32 --repeat 3

Both run greedy in this process with the same torch threads: ``model.generate(do_sample=False)`` on the
left-padded batch, and the engine's scheduler on the same prompts submitted at once (one decode wave, no
HTTP in the way: requests go straight to ``EmbeddedServer.submit``). Every row must come out identical
(the benchmark stops otherwise); then the JSON in ``benchmarks/results/`` holds both sides' tokens/s
(new tokens of the batch / wall time; the median of ``--repeat`` alternated runs) and their ratio
(> 1: the engine is faster). ``--model tiny`` uses the random Qwen2 of ``slimecore.testing.tiny``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_trl import QUESTION, model_dir  # noqa: E402  (the same prompts and models as the TRL comparison)


def prompts(tokenizer, n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTION.format(a=rng.randint(0, 99),
                                                                                    b=rng.randint(0, 99))}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for _ in range(n)]


def hf_generate(model, pad_id: int, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()


def engine_generate(server, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [server.submit(server.new_request({"input_ids": p, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})) for p in batch]
    for req in reqs:
        req.done.wait()
    return [req.output_ids for req in reqs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/engine_decode_<model>_<date>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from slimecore.engines.embedded import EmbeddedServer

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.model, Path(tmp))
        server = EmbeddedServer(path, max_batch_size=args.batch, num_threads=args.threads)
        server.start()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # no stop token, as the engine's ignore_eos
        batch = prompts(server.tokenizer, args.batch)
        times: dict[str, list[float]] = {"generate": [], "engine": []}
        loads = []
        try:
            for i in range(args.repeat + 1):  # the first round warms both up and is left out
                for name in (("generate", "engine") if i % 2 else ("engine", "generate")):
                    load = os.getloadavg()[0]
                    start = time.perf_counter()
                    out = (hf_generate(model, server.pad_id, batch, args.new_tokens) if name == "generate"
                           else engine_generate(server, batch, args.new_tokens))
                    elapsed = time.perf_counter() - start
                    if name == "generate":
                        expected = out
                    elif i and out != expected:
                        raise SystemExit("the engine's greedy outputs differ from model.generate's")
                    if i:
                        times[name].append(elapsed)
                        loads.append(load)
        finally:
            server.stop()
    tokens = args.batch * args.new_tokens
    summary = {name: {"median_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
               for name, t in times.items()}
    summary["engine_over_generate"] = summary["engine"]["tokens_per_s"] / summary["generate"]["tokens_per_s"]
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or HERE / "results" / f"engine_decode_{args.model}_{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
                               "threads": args.threads, "repeat": args.repeat, "greedy_outputs_identical": True,
                               "date": date.isoformat(timespec="seconds"), "load_average_seen": loads,
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "torch": torch.__version__, "summary": summary, "times": times}, indent=1))
    print(f"generate {summary['generate']['tokens_per_s']:.0f} tok/s, engine {summary['engine']['tokens_per_s']:.0f} "
          f"tok/s = {summary['engine_over_generate']:.2f}x (identical greedy outputs); load {min(loads):.1f}-"
          f"{max(loads):.1f}; written to {out}")


if __name__ == "__main__":
    main()
