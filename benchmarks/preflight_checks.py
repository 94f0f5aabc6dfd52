"""Seconds from ``slime-core train`` starting to its exit, for each bad input checked before Ray starts.

    python benchmarks/preflight_checks.py --repeats 2 --out benchmarks/results/preflight_checks.json

The cases are those of ``tests/test_faults.py`` (``BEFORE_RAY``: a malformed jsonl line, a missing label key,
an unknown ``--input-key``, an empty or missing prompt file, a bad parquet column, a bad slice, a bad chat
role, a corrupt ``--hf-checkpoint``, a ``--load`` of another model's shape, an unwritable ``--save``, a sync
``def slime_reward``, a placement the machine cannot hold, ...) on the tiny model, each run as a user runs it
(one process, the grpo plugin). Per case: the wall seconds and the CPU seconds of the process (user + system;
the wall time on a busy machine is mostly waiting for a core), the median over ``--repeats``, and the load
average seen. The first run of all warms the page cache and the weights-shape cache (``preflight``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run_case(args: list[str]) -> tuple[float, float, int, str]:
    """(wall s, CPU s, exit code, last stderr line) of one CLI run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return wall, cpu, proc.returncode, (lines[-1] if lines else proc.stderr.strip()[-300:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/preflight_checks.json")
    args = parser.parse_args()
    for key, value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(key, value)
    import test_faults as cases  # the bad inputs the tests assert on
    from slimecore.testing.tiny import make_tiny_checkpoint

    base = Path(tempfile.mkdtemp(prefix="preflight-bench-"))
    tiny = make_tiny_checkpoint(base / "tiny")
    warm = Path(tempfile.mkdtemp(dir=base))  # warm-up: the page cache, the weights-shape cache of ``tiny``
    run_case(cases._args(tiny, warm, *cases.BEFORE_RAY["--load of another model's shape"][0](warm, tiny)))
    results = {}
    for name, (make_args, _) in cases.BEFORE_RAY.items():
        runs = []
        for _ in range(args.repeats):
            case_dir = Path(tempfile.mkdtemp(dir=base))
            load = os.getloadavg()[0]
            wall, cpu, code, message = run_case(cases._args(tiny, case_dir, *make_args(case_dir, tiny)))
            runs.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load": round(load, 1), "exit": code})
        results[name] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                         "cpu_s": statistics.median(r["cpu_s"] for r in runs), "runs": runs, "message": message[:300]}
        print(f"{results[name]['wall_s']:6.2f}s wall {results[name]['cpu_s']:5.2f}s cpu  {name}", flush=True)
    report = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "python": platform.python_version(), "repeats": args.repeats, "cases": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
