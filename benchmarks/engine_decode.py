"""The embedded engine's decode speed against ``model.generate()`` on the same batch, model and length.

    python benchmarks/engine_decode.py --model smollm2 --batch 16 --new-tokens 32 --repeat 3
    python benchmarks/engine_decode.py --model tiny --rollout --repeat 10

Decode (default): greedy, in this process, the same torch threads, three sides alternated in turn:
``model.generate(do_sample=False)`` on the left-padded batch, and the engine's scheduler on the same
prompts submitted at once (one decode wave, no HTTP: requests go straight to ``EmbeddedServer.submit``),
once with its own decode step (``engine``, slimecore.engines.fastpath) and once with HF's forward for
every step (``engine_hf_step``, the engine as it was before that step existed). Every row must come out
identical on every side (the benchmark stops otherwise).

Rollout (``--rollout``): the request path of a rollout on small work, the vs-TRL tiny config by default
(8 prompts x 8 samples, 16 new tokens, temperature 1): the 64 samples go from the rollout client through
the real sglang-router to the engine's HTTP server, one request per prompt group as the built-in rollout
sends them (``rollout_grouped``: 8 batch requests, ``slimecore.rollout.client.SharedRequests``) and one
``/generate`` call per sample (``rollout``: 64 calls), against ``model.generate(do_sample=True)`` on the same
64 rows (what TRL's rollout runs) and against the engine scheduled as before the batching work
(``rollout_before``: 64 calls, at most 32 rows at once, and a wave that waits the whole gather window).

The JSON in ``benchmarks/results/`` holds each side's tokens/s (new tokens / wall time; the median of
``--repeat`` rounds, after a first round left out), the ratios, the 1-minute load average before every
run, the machine and the date. ``--model tiny`` uses the random Qwen2 of ``slimecore.testing.tiny``.
"""

from __future__ import annotations

import argparse
import asyncio
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


def hf_generate(model, pad_id: int, batch: list[list[int]], new_tokens: int, sample: bool = False) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=sample,
                             pad_token_id=pad_id, **({"top_k": None, "top_p": None} if sample else {}))
    return out[:, width:].tolist()


def engine_generate(server, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [server.submit(server.new_request({"input_ids": p, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})) for p in batch]
    for req in reqs:
        req.done.wait()
    return [req.output_ids for req in reqs]


def alternate(sides: dict, repeat: int) -> tuple[dict[str, list[float]], list[float], dict]:
    """Run every side ``repeat + 1`` times in turn (the order rotates each round; round 0 warms up and is
    left out); returns the times per side, the load before each run and every side's last output."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    loads, outputs = [], {}
    names = list(sides)
    for i in range(repeat + 1):
        for name in names[i % len(names):] + names[:i % len(names)]:
            load = os.getloadavg()[0]
            start = time.perf_counter()
            outputs[name] = sides[name]()
            if i:
                times[name].append(time.perf_counter() - start)
                loads.append(load)
    return times, loads, outputs


def decode_sides(server, model, batch, new_tokens: int) -> dict:
    fast = server.fast

    def engine(step):
        def run():
            server.fast = step  # None: HF's forward decodes every step
            return engine_generate(server, batch, new_tokens)
        return run

    return {"generate": lambda: hf_generate(model, server.pad_id, batch, new_tokens),
            "engine": engine(fast), "engine_hf_step": engine(None)}


def rollout_sides(server, model, batch, new_tokens: int, loop, group: int = 8) -> dict:
    """The samples through the real router (one client, one event loop): one call each, or one request per
    ``group`` consecutive rows (the samples of one prompt), as the rollout sends them."""
    from slimecore.engines.router import Router
    from slimecore.rollout.client import RolloutClient, SharedRequests

    router = Router([server.url]).start()
    router.wait_ready(1)
    client = RolloutClient(router.url)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    now = {"max_batch_size": server.max_batch_size, "gather_quiet": server.gather_quiet}
    before = {"max_batch_size": 32, "gather_quiet": server.gather_window}

    async def one_group(rows):
        with SharedRequests():
            return await asyncio.gather(*(client.generate(p, params) for p in rows))

    def rollout(settings, grouped=False):
        def run():
            for key, value in settings.items():
                setattr(server, key, value)

            async def calls():
                if not grouped:
                    return await asyncio.gather(*(client.generate(p, params) for p in batch))
                groups = await asyncio.gather(*(one_group(batch[i:i + group]) for i in range(0, len(batch), group)))
                return [out for outs in groups for out in outs]
            return [out["output_ids"] for out in loop.run_until_complete(calls())]
        return run

    sides = {"generate": lambda: hf_generate(model, server.pad_id, batch, new_tokens, sample=True),
             "rollout_grouped": rollout(now, grouped=True), "rollout": rollout(now), "rollout_before": rollout(before)}
    sides["_close"] = lambda: (loop.run_until_complete(client.close()), router.stop())
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--rollout", action="store_true", help="time the rollout request path (see above)")
    parser.add_argument("--batch", type=int, default=None, help="rows (default: 16; --rollout: 8 prompts x 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32; --rollout: 16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/engine_decode[_rollout]_<model>_<date>.json")
    args = parser.parse_args()
    batch_size = args.batch or (64 if args.rollout else 16)
    new_tokens = args.new_tokens or (16 if args.rollout else 32)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from slimecore.engines.embedded import EmbeddedServer

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.model, Path(tmp))
        server = EmbeddedServer(path, max_batch_size=64 if args.rollout else batch_size, num_threads=args.threads)
        server.start()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # no stop token, as the engine's ignore_eos
        if args.rollout:
            batch = [p for p in prompts(server.tokenizer, batch_size // 8) for _ in range(8)]
            loop = asyncio.new_event_loop()
            sides = rollout_sides(server, model, batch, new_tokens, loop)
            close = sides.pop("_close")
        else:
            batch, close = prompts(server.tokenizer, batch_size), None
            if server.fast is None:
                raise SystemExit(f"the engine has no fast decode step for {args.model}")
            sides = decode_sides(server, model, batch, new_tokens)
        try:
            times, loads, outputs = alternate(sides, args.repeat)
        finally:
            if close:
                close()
            server.stop()
    if not args.rollout and not outputs["generate"] == outputs["engine"] == outputs["engine_hf_step"]:
        raise SystemExit("the engine's greedy outputs differ from model.generate's")
    if args.rollout and not all(len(row) == new_tokens for out in outputs.values() for row in out):
        raise SystemExit("a side generated another number of tokens")
    tokens = batch_size * new_tokens
    summary = {name: {"median_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
               for name, t in times.items()}
    for name in times:
        if name != "generate":
            summary[f"{name}_over_generate"] = summary[name]["tokens_per_s"] / summary["generate"]["tokens_per_s"]
    date = datetime.datetime.now(datetime.timezone.utc)
    kind = "engine_decode_rollout" if args.rollout else "engine_decode"
    out = Path(args.out or HERE / "results" / f"{kind}_{args.model}_{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "mode": "rollout" if args.rollout else "decode",
                               "batch": batch_size, "new_tokens": new_tokens, "threads": args.threads,
                               "repeat": args.repeat, "greedy_outputs_identical": not args.rollout,
                               "date": date.isoformat(timespec="seconds"), "load_average_seen": loads,
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "torch": torch.__version__, "summary": summary, "times": times}, indent=1))
    print(", ".join(f"{name} {s['tokens_per_s']:.0f} tok/s" for name, s in summary.items() if "_over_" not in name)
          + "; " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items() if "_over_" in k)
          + f"; load {min(loads):.1f}-{max(loads):.1f}; written to {out}")


if __name__ == "__main__":
    main()
