"""The agent session layer against raw ``/generate`` on the same multi-turn work.

    python benchmarks/agent_sessions.py --episodes 16 --turns 4 --concurrency 8 \
        --out benchmarks/results/agent_sessions_tiny.json

Session mode: ``--episodes`` agent episodes, ``--concurrency`` at a time, each ``--turns`` requests to
``/v1/chat/completions`` (plain HTTP JSON, so an SDK's own cost stays out of it; from a process of their own,
as agents are programs), every request the whole
history plus a new user message, ``--max-tokens`` new tokens a turn, greedy. Raw mode then replays exactly the
prompt ids the session layer sent, turn after turn per episode with the same concurrency, from the same kind
of process, straight to the engine's ``/generate`` (``input_ids``, ``return_logprob``): the same tokens in and, greedy, the same tokens out.
Both go to one embedded engine in its own process, as engines run in a training run (Ray actors), with
``ignore_eos`` so every turn generates ``--max-tokens`` tokens in both modes. Reported per mode: wall time, generated tokens/s, mean and
median latency per turn; then the session layer's added latency per turn and its tokens/s relative to raw
(goal: within 10%), and the session layer's own CPU time per turn (the process serving the sessions does
nothing else meanwhile; unlike wall time, it hardly moves with the machine's load), of which building the prompt
ids (replayed offline on one thread, and checked to be the ids sent). ``--model smollm2`` uses the converted SmolLM2-135M-Instruct (``slime-core train`` converts
it on first use); ``tiny`` a random 4-layer, 256-wide Qwen2 built locally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def user_message(episode: int, turn: int) -> dict:
    return {"role": "user", "content": f"Episode {episode}, question {turn}: what is {turn} + {episode}?"}


def prompt_cpu_ms_per_turn(template, states, repeats: int = 5) -> float:
    """CPU time per turn of building the prompt ids and recording the turn (``Trajectory.prompt`` / ``record``:
    rendering, tokenising, matching the history), replaying the recorded sessions' conversations offline on
    one thread; each rebuilt prompt must equal the ids the session layer sent."""
    from slimecore.agents.trajectory import Trajectory

    start, turns = time.process_time(), 0
    for _ in range(repeats):
        for index, state in enumerate(states):
            trajectory, messages = Trajectory(template), [SYSTEM]
            for number, turn in enumerate(state.trajectory.turns):
                messages.append(user_message(index, number))
                prompt = trajectory.prompt(messages, None)
                assert prompt.ids == turn.prompt_ids, "the replayed prompt must be the one the session sent"
                answer = {"role": "assistant", "content": turn.text}
                trajectory.record(prompt, turn.output_ids, turn.log_probs, turn.finish, answer, None, turn.text)
                messages.append(answer)
                turns += 1
    return 1000 * (time.process_time() - start) / turns


async def session_episodes(url: str, session_ids: list[str], turns: int, concurrency: int, max_tokens: int):
    """The agents' side: each session's episode as plain HTTP JSON requests to ``/v1/chat/completions``."""
    latencies, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def episode(http: aiohttp.ClientSession, index: int, sid: str):
        nonlocal tokens
        messages = [SYSTEM]
        async with gate:
            for turn in range(turns):
                messages.append(user_message(index, turn))
                start = time.perf_counter()
                async with http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {sid}"},
                                     json={"model": "m", "messages": messages, "max_tokens": max_tokens}) as response:
                    data = await response.json()
                    if response.status != 200:
                        raise RuntimeError(data)
                latencies.append(time.perf_counter() - start)
                tokens += data["usage"]["completion_tokens"]
                messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(episode(http, i, sid) for i, sid in enumerate(session_ids)))
    return time.perf_counter() - start, latencies, tokens


async def raw_episodes(url: str, prompts: list[list[list[int]]], concurrency: int, max_tokens: int):
    """The same turns straight to the engine's ``/generate``, replaying the prompt ids the session layer sent."""
    from slimecore.rollout.client import RolloutClient

    client = RolloutClient(url)
    latencies, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def episode(turn_prompts):
        nonlocal tokens
        async with gate:
            for ids in turn_prompts:
                start = time.perf_counter()
                out = await client.generate(ids, {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                                  "skip_special_tokens": True}, return_logprob=True)
                latencies.append(time.perf_counter() - start)
                tokens += len(out["output_ids"])

    start = time.perf_counter()
    try:
        await asyncio.gather(*(episode(p) for p in prompts))
    finally:
        await client.close()
    return time.perf_counter() - start, latencies, tokens


def run_client(mode: str, *args):
    """Child process: one mode's client side (agents are programs of their own, not threads of the rollout)."""
    return asyncio.run(session_episodes(*args) if mode == "session" else raw_episodes(*args))


def serve_engine(checkpoint: str, max_batch_size: int, urls) -> None:
    """Child process: one embedded engine until the parent terminates it."""
    import threading

    from slimecore.engines.embedded import EmbeddedServer

    urls.put(EmbeddedServer(checkpoint, max_batch_size=max_batch_size).start())
    threading.Event().wait()


def summarize(wall: float, latencies: list[float], tokens: int, cpu: float | None = None,
              prompt_cpu_ms: float | None = None) -> dict:
    summary = {"wall_s": wall, "turns": len(latencies), "generated_tokens": tokens, "tokens_per_s": tokens / wall,
               "latency_mean_ms": 1000 * statistics.fmean(latencies),
               "latency_median_ms": 1000 * statistics.median(latencies)}
    if cpu is not None:  # the session layer's own CPU time (HTTP both ways, rendering, tokenising, recording)
        summary["session_cpu_ms_per_turn"] = 1000 * cpu / len(latencies)
        summary["prompt_cpu_ms_per_turn"] = prompt_cpu_ms
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="session/raw pairs, run alternately")
    parser.add_argument("--out", default="benchmarks/results/agent_sessions.json")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from slimecore.agents.server import SessionServer
    from slimecore.hf_checkpoint import load_tokenizer
    from slimecore.rollout.client import RolloutClient

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            from slimecore.testing.tiny import make_tiny_checkpoint

            checkpoint = make_tiny_checkpoint(Path(tmp) / "model", hidden=256, layers=4, heads=8, kv_heads=4)
        else:
            from slimecore.hf_checkpoint import default_checkpoint_dir

            checkpoint = default_checkpoint_dir()
        tokenizer = load_tokenizer(str(checkpoint))
        context = multiprocessing.get_context("spawn")
        urls = context.Queue()
        engine = context.Process(target=serve_engine, args=(str(checkpoint), args.concurrency, urls), daemon=True)
        engine.start()
        try:
            engine_url = urls.get(timeout=300)
            server = SessionServer(RolloutClient(engine_url, tokenizer=tokenizer), tokenizer).start()
            runs = []
            clients = ProcessPoolExecutor(max_workers=1, mp_context=context)

            def session_run():
                states = [server.open({"max_new_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True})
                          for _ in range(args.episodes)]
                cpu = time.process_time()  # this process runs only the session server meanwhile
                result = clients.submit(run_client, "session", server.url, [st.id for st in states], args.turns,
                                        args.concurrency, args.max_tokens).result()
                cpu = time.process_time() - cpu
                for st in states:
                    server.close(st.id)
                return (*result, cpu, prompt_cpu_ms_per_turn(server.template, states)), \
                    [[t.prompt_ids for t in st.trajectory.turns] for st in states]

            try:
                # warm-up pair, not reported (first connections, template compilation, the engine's first waves); greedy
                # decoding makes every repeat the same work, so its prompt ids are what raw mode replays
                _, prompts = session_run()
                raw_args = (engine_url, prompts, args.concurrency, args.max_tokens)
                clients.submit(run_client, "raw", *raw_args).result()
                for repeat in range(args.repeats):  # alternate which mode goes first
                    run = {}
                    for mode in (("session", "raw") if repeat % 2 == 0 else ("raw", "session")):
                        if mode == "session":
                            result, replayed = session_run()
                            assert replayed == prompts, "greedy episodes must repeat exactly"
                        else:
                            result = clients.submit(run_client, "raw", *raw_args).result()
                        run[mode] = summarize(*result)
                    runs.append(run)
            finally:
                server.stop()
                clients.shutdown()
        finally:
            engine.terminate()
            engine.join(30)
    best = {mode: max((r[mode] for r in runs), key=lambda s: s["tokens_per_s"]) for mode in ("session", "raw")}
    median = {mode: {key: statistics.median(r[mode][key] for r in runs) for key in runs[0][mode]}
              for mode in ("session", "raw")}
    comparison = {"tokens_per_s_ratio": median["session"]["tokens_per_s"] / median["raw"]["tokens_per_s"],
                  "added_latency_per_turn_ms": median["session"]["latency_mean_ms"] - median["raw"]["latency_mean_ms"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "median": median, "best": best, "comparison": comparison, "runs": runs}, indent=1))
    print("| mode | tokens/s (median of runs) | mean latency per turn (ms) | median latency per turn (ms) |")
    print("|---|---|---|---|")
    for mode in ("raw", "session"):
        m = median[mode]
        print(f"| {mode} | {m['tokens_per_s']:.1f} | {m['latency_mean_ms']:.1f} | {m['latency_median_ms']:.1f} |")
    print(f"session/raw tokens/s: {comparison['tokens_per_s_ratio']:.3f}; added latency per turn: "
          f"{comparison['added_latency_per_turn_ms']:.1f} ms; session layer CPU per turn: "
          f"{median['session']['session_cpu_ms_per_turn']:.2f} ms (building prompts: "
          f"{median['session']['prompt_cpu_ms_per_turn']:.2f} ms); written to {out}")


if __name__ == "__main__":
    main()
