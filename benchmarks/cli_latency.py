"""Seconds the small commands take, and how soon each says its first line, as a user runs them.

    python benchmarks/cli_latency.py --repeats 5 --out benchmarks/results/cli_latency.json

Each command runs in its own process from a scratch folder (so `runs` reads an empty runs/): `--help`,
`plugins` (and `--json`), `hooks`, `models`, `runs`, `train --plugin grpo --help`, `train --help-all`, a mistyped
`train` flag (its did-you-mean error), `data`; plus `train` of the quick start on the tiny model, stopped as soon
as its first console line is out (the goal: within 2 s). Per command: the median wall seconds to exit and to the
first line over ``--repeats``, the CPU seconds (user + system; the wall time on a busy machine is mostly waiting
for a core) and the 1-minute load average seen before each run. The plugin listing's cache is warmed first (its
cold time, every plugin imported once, is reported apart). Goals (issue 29): every small command under 3 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "slimecore_cli"]
COMMANDS = {
    "--help": ["--help"],
    "plugins": ["plugins"],
    "plugins --json": ["plugins", "--json"],
    "hooks": ["hooks"],
    "models": ["models"],
    "runs": ["runs"],
    "train --plugin grpo --help": ["train", "--plugin", "grpo", "--help"],
    "train --help-all": ["train", "--help-all"],
    "mistyped flag": ["train", "--plugin", "grpo", "--rollout-bach-size", "4"],
    "data": ["data", "--task", "arithmetic", "-n", "100", "-o", "arith.jsonl"],
}


def run(args: list[str], cwd: Path, env: dict, stop_after_first_line: bool = False) -> dict:
    """Wall seconds to exit and to the first line (stdout or stderr), CPU seconds and exit code of one run.
    ``stop_after_first_line``: SIGINT the command's process group once its first line is out (a training run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    first = None
    selector = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        selector.register(stream, selectors.EVENT_READ)
    open_streams = 2
    while open_streams:
        for key, _ in selector.select(timeout=600):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            if first is None and b"\n" in chunk:
                first = time.perf_counter() - start
                if stop_after_first_line:
                    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": round(wall, 2), "first_line_s": None if first is None else round(first, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "load": round(load, 1), "exit": code}


def summarize(runs: list[dict]) -> dict:
    firsts = [r["first_line_s"] for r in runs if r["first_line_s"] is not None]
    return {"wall_s": statistics.median(r["wall_s"] for r in runs),
            "first_line_s": statistics.median(firsts) if firsts else None,
            "cpu_s": statistics.median(r["cpu_s"] for r in runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cli_latency.json")
    args = parser.parse_args()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    scratch = Path(tempfile.mkdtemp(prefix="cli-latency-"))
    env["SLIMECORE_CACHE"] = str(scratch / "cache")  # the plugin listing's cache, cold for the first run
    results = {"plugins (cold cache: every plugin imported)": summarize([run(CLI + ["plugins"], scratch, env)])}
    for name, argv in COMMANDS.items():
        results[name] = summarize([run(CLI + argv, scratch, env) for _ in range(args.repeats)])
        print(f"{results[name]['wall_s']:6.2f}s wall  {results[name]['first_line_s']}s first line  "
              f"{results[name]['cpu_s']:5.2f}s cpu  {name}", flush=True)
    sys.path.insert(0, str(ROOT))
    from slimecore.testing.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(scratch / "tiny")
    train = CLI + ["train", "--plugin", "grpo", "--hf-checkpoint", str(tiny), "--no-use-tensorboard"]
    results["train: first console line"] = summarize(
        [run(train + ["--log-dir", str(scratch / f"run{i}")], scratch, env, stop_after_first_line=True)
         for i in range(args.repeats)])
    print(f"{results['train: first console line']['first_line_s']}s  train: first console line", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "commit": commit.strip(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "python": platform.python_version(), "repeats": args.repeats, "goal_s": 3.0,
              "goal_first_line_s": 2.0, "commands": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
