"""Every failure in one line that names its cause: bad input from the command line fails before Ray with one
line, exit 2 and in seconds; faults inside a run are reported naming the plugin, hook, process or request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slimecore.testing import timeout as scaled

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *args], capture_output=True, text=True,
                          timeout=scaled(timeout), env=env)
    return proc, time.perf_counter() - start


def _error_line(stderr: str) -> str:
    """The ``error:`` line (with its wrapped continuation: rich wraps at the terminal width)."""
    text = " ".join(stderr.split())
    assert text.count("error:") == 1, stderr
    return text[text.index("error:"):]


def _rows(path, n: int) -> str:
    path.write_text("".join(json.dumps({"input": f"Is {i} > 3?", "label": "yes"}) + "\n" for i in range(n)))
    return str(path)


def _parquet_of_int_lists(path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [[1, 2, 3], [4, 5]], "label": ["a", "b"]}), path)
    return str(path)


def _latin1(path) -> str:
    path.write_bytes(b'{"input": "ok", "label": "1"}\n{"input": "caf\xe9", "label": "1"}\n')
    return str(path)


def _without_router_binary(tmp_path) -> list[str]:
    """Put first on the path an ``sglang_router`` package that lacks its compiled router, as a broken install has."""
    package = tmp_path / "shadow" / "sglang_router"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    return []


# (case, extra arguments from tmp_path, expected words of the one error line)
BEFORE_RAY = [
    ("slice past the file", lambda t: ["--prompt-data", _rows(t / "good.jsonl", 20) + "@[15:100]"],
     ["--prompt-data", "good.jsonl@[15:100]", "reaches row 100", "has 20 rows"]),
    ("not UTF-8", lambda t: ["--prompt-data", _latin1(t / "latin1.jsonl")],
     ["latin1.jsonl, line 2: not UTF-8 (byte 0xe9 at column 15)"]),
    ("parquet list column", lambda t: ["--prompt-data", _parquet_of_int_lists(t / "ids.parquet")],
     ["ids.parquet, row 1: 'input'", "got a list of 3 int values"]),
    ("unwritable log dir", lambda t: ["--log-dir", str(_rows(t / "a-file", 1)) + "/run"],
     ["--log-dir", "a-file/run", "cannot create it", "give a --log-dir you can write to"]),
    ("response longer than the context", lambda t: ["--rollout-max-response-len", "100000"],
     ["--rollout-max-response-len 100000 does not fit the model's context of 512 tokens",
      "Give --rollout-max-response-len"]),
    ("router without its binary", _without_router_binary,
     ["compiled router (sglang_router.sglang_router_rs) is not installed"]),
]


@pytest.mark.parametrize("case,extra,expected", BEFORE_RAY, ids=[c[0] for c in BEFORE_RAY])
def test_bad_input_fails_before_ray_in_one_line(tiny_checkpoint, tmp_path, case, extra, expected):
    args = ["--plugin", "grpo", "--hf-checkpoint", str(tiny_checkpoint), "--rm-type", "math",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--log-dir", str(tmp_path / "log")]
    shadow = tmp_path / "shadow"  # where a case puts packages that hide installed ones
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    proc, seconds = _cli(*args, *extra(tmp_path), env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    for words in expected:
        assert words in line, line
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
    assert seconds < scaled(60), seconds
