"""Bad input and faults as a user meets them through ``slime-core train`` (one process per run, the tiny
model): each case asserts the message (what went wrong and what to do) and how long it took to fail.

Checks made before Ray starts must fail in under 10 s; faults inside a run must stop it with the original
message, the plugin and the process it came from, never Ray's ``UnserializableException`` or a hang. Limits
scale with ``SLIMECORE_TEST_TIMEOUT_SCALE``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from fixtures_engine import shm_left_behind, torch_shm_files

from slimecore.preflight import LOCK_FILE
from slimecore.testing import timeout
from slimecore.testing.tiny import make_tiny_checkpoint

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
HERE = Path(__file__).parent
FAULTY = str(HERE / "faulty_plugin.py")
ROWS = [{"input": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def _jsonl(path: Path, rows: list, lines: list[str] = ()) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(lines))
    return str(path)


def _args(checkpoint, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint", str(checkpoint),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--num-rollout", "2", "--log-dir", str(tmp_path / "log"), "--no-use-tensorboard", *extra]


def _train(args: list[str], limit: float, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, str]:
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=limit + timeout(60),
                          env={**os.environ, **(env or {})})
    return proc, time.perf_counter() - start, " ".join(proc.stderr.split())


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- before Ray starts ----------------------------------------------------------------------------------


def _own_data(tmp_path: Path, rows=ROWS, lines=()) -> list[str]:
    return ["--prompt-data", _jsonl(tmp_path / "data.jsonl", rows, lines), "--label-key", "label", "--rm-type", "math"]


def _parquet(tmp_path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b"], "label": ["1", "2"]}), tmp_path / "data.parquet")
    return ["--prompt-data", str(tmp_path / "data.parquet"), "--label-key", "label", "--rm-type", "math"]


def _corrupt_checkpoint(tmp_path: Path, tiny: Path) -> list[str]:
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for file in tiny.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    (bad / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64,')
    return ["--hf-checkpoint", str(bad)]


def _other_model_checkpoint(tmp_path: Path, tiny: Path) -> list[str]:
    other = make_tiny_checkpoint(tmp_path / "other", hidden=32)
    actor = tmp_path / "ckpt" / "iter_0000000" / "actor"
    actor.mkdir(parents=True)
    (actor / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    (actor.parent / "rollout_state.pt").write_bytes(b"")
    return ["--load", str(tmp_path / "ckpt")]


def _sync_reward(tmp_path: Path, tiny: Path) -> list[str]:
    plugin = tmp_path / "sync_reward.py"
    plugin.write_text("from slimecore import hookimpl\n\n\n@hookimpl\ndef slime_reward(config, sample):\n    return 1.0\n")
    return ["--plugin", str(plugin)]


def _latin1(tmp_path: Path) -> list[str]:
    (tmp_path / "latin1.jsonl").write_bytes(b'{"input": "ok", "label": "1"}\n{"input": "caf\xe9", "label": "1"}\n')
    return ["--prompt-data", str(tmp_path / "latin1.jsonl"), "--label-key", "label", "--rm-type", "math"]


def _parquet_of_int_lists(tmp_path: Path, tiny: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [[1, 2, 3], [4, 5]], "label": ["a", "b"]}), tmp_path / "ids.parquet")
    return ["--prompt-data", str(tmp_path / "ids.parquet"), "--label-key", "label", "--rm-type", "math"]


def _router_without_binary(tmp_path: Path, tiny: Path) -> list[str]:
    """An ``sglang_router`` package without its compiled router, found first (``SHADOW`` is on the path)."""
    package = tmp_path / SHADOW / "sglang_router"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    return []


SHADOW = "shadow"  # a folder of each case's tmp_path put first on PYTHONPATH: packages there hide installed ones
BEFORE_RAY = {
    "malformed jsonl line": (lambda t, c: _own_data(t, lines=["{not json\n"]),
                             ["data.jsonl, line 5: invalid JSON", "each line must be one JSON object"]),
    "rows without the label key": (lambda t, c: _own_data(t, rows=ROWS + [{"input": "x"}]),
                                   ["line 5: no key 'label'", "set --label-key"]),
    "unknown --input-key": (lambda t, c: _own_data(t) + ["--input-key", "question"],
                            ["line 1: no key 'question'", "set --input-key to the key holding the prompt"]),
    "empty prompt file": (lambda t, c: _own_data(t, rows=[]), ["has no rows", "fill it"]),
    "missing prompt file": (lambda t, c: ["--prompt-data", str(t / "nope.jsonl"), "--rm-type", "math"],
                            ["nope.jsonl does not exist", "check the path"]),
    "bad parquet column": (lambda t, c: _parquet(t), ["data.parquet, row 1: no key 'input'", "set --input-key"]),
    "bad slice": (lambda t, c: ["--prompt-data", _jsonl(t / "d.jsonl", ROWS) + "@[4:4]", "--rm-type", "math"],
                  ["the slice selects none of the 4 rows", "use a range within 0..4"]),
    "slice past the file's rows": (lambda t, c: ["--prompt-data", _jsonl(t / "d.jsonl", ROWS * 5) + "@[15:100]",
                                                 "--rm-type", "math"],
                                   ["--prompt-data", "d.jsonl@[15:100]': the slice reaches row 100 but",
                                    "has 20 rows", "@[15:]"]),
    "non-UTF-8 bytes in the jsonl": (lambda t, c: _latin1(t), ["latin1.jsonl, line 2: not UTF-8 (byte 0xe9 at column",
                                                                "save the file as UTF-8"]),
    "parquet column of int lists": (_parquet_of_int_lists, ["ids.parquet, row 1: 'input' must be a string or a list of "
                                                            "chat messages", "got a list of 3 int values"]),
    "unwritable --log-dir": (lambda t, c: ["--log-dir", _jsonl(t / "file.jsonl", []) + "/run"],
                             ["--log-dir", "file.jsonl/run: cannot create it", "give a --log-dir you can write to"]),
    "response longer than the model's context": (
        lambda t, c: ["--rollout-max-response-len", "100000"],
        ["--rollout-max-response-len 100000 does not fit the model's context of 512 tokens",
         "Give --rollout-max-response-len"]),
    "reward service on a closed port": (
        lambda t, c: ["--prompt-data", _jsonl(t / "d.jsonl", ROWS), "--label-key", "label", "--rm-type", "remote_rm",
                      "--rm-url", _dead_url()],
        ["--rm-url http://127.0.0.1:", "the reward service cannot be reached at 127.0.0.1:", "Connection refused",
         "start it, or fix --rm-url"]),
    "sglang-router without its compiled router": (_router_without_binary, [
        "compiled router (sglang_router.sglang_router_rs) is not installed", "pip install --force-reinstall"]),
    "bad chat role": (lambda t, c: _own_data(t, rows=[{"input": [{"role": "human", "content": "hi"}], "label": "1"}])
                      + ["--apply-chat-template"], ["message 1 has role 'human'", "among system, user, assistant"]),
    "corrupt --hf-checkpoint": (_corrupt_checkpoint, ["config.json cannot be loaded", "restore it"]),
    "--load of another model's shape": (_other_model_checkpoint,
                                        ["was saved from another model than --hf-checkpoint", "model.embed_tokens"]),
    "unwritable --save": (lambda t, c: ["--save", _jsonl(t / "file.jsonl", []) + "/ckpt"],
                          ["--save", "cannot write there", "choose a directory you can write to"]),
    "sync def slime_reward": (_sync_reward, ["plugin 'sync_reward'", "slime_reward must be declared with `async def`"]),
    "--num-rollout -1": (lambda t, c: ["--num-rollout", "-1"], ["--num-rollout must be >= 1", "omit it"]),
    "--num-rollout 0": (lambda t, c: ["--num-rollout", "0"], ["--num-rollout must be >= 1"]),
    "own data without --rm-type": (lambda t, c: ["--prompt-data", _jsonl(t / "d.jsonl", ROWS), "--label-key", "label"],
                                   ["line 1: no reward type for your own data", "Set --rm-type", "rm_type"]),
    # a run that starts its own Ray instance on a machine without GPUs: its placement is known before Ray starts
    "placement the machine cannot hold": (lambda t, c: ["--num-cpus-per-actor", "4096"],
                                          ["the cluster cannot hold this run", "need 8192 CPU (the cluster has",
                                           "Lower --num-cpus-per-actor"]),
}


@pytest.mark.parametrize("case", list(BEFORE_RAY))
def test_bad_input_fails_before_ray_with_one_clear_message(case, tiny_checkpoint, tmp_path):
    make_args, expected = BEFORE_RAY[case]
    args = _args(tiny_checkpoint, tmp_path, *make_args(tmp_path, tiny_checkpoint))
    cpu_before = _children_cpu()
    proc, seconds, stderr = _train(args, timeout(10), env={"PYTHONPATH": str(tmp_path / SHADOW)})
    cpu = _children_cpu() - cpu_before
    assert proc.returncode == 2, proc.stderr[-3000:]
    for text in expected:
        assert text in stderr, (text, proc.stderr[-3000:])
    assert "Started a local Ray instance" not in stderr and "Traceback" not in stderr
    assert proc.stderr.count("error:") == 1, proc.stderr[-3000:]  # one message
    # under 10 s: the command's own CPU time, which other jobs on the machine do not stretch; its wall time
    # (which they do: 10-14 s at load 10-14 on 2 cores) only within 10 s per unit of load per core
    assert cpu < timeout(10), f"{case}: used {cpu:.1f}s of CPU before failing"
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert seconds < timeout(10) * busy, f"{case}: failed after {seconds:.1f}s (load per core {busy:.1f})"


# -- inside a run --------------------------------------------------------------------------------------


def _dead_url() -> str:
    from slimecore.engines.router import free_port

    return f"http://127.0.0.1:{free_port()}/reward"  # nothing listens there


def _import_fails_in_workers(tmp_path: Path) -> list[str]:
    plugin = tmp_path / "driver_only.py"
    plugin.write_text(
        "from ray._private.worker import WORKER_MODE, global_worker\n\n"
        "if global_worker.mode == WORKER_MODE:\n"
        "    raise ImportError(\"No module named 'gpu_only_dep' (installed on the driver only)\")\n")
    return ["--plugin", str(plugin)]


IN_RUN = {
    "reward raises on every sample": (
        lambda t: ["--plugin", FAULTY, "--fault", "reward-raises"],
        ["4 of 4 samples failed to be scored, more than --max-reward-failure-fraction 0.5",
         "plugin 'faulty_plugin' raised in slime_reward: ValueError: the judge cannot parse sample",
         "raise --max-reward-failure-fraction", "process RolloutManager.generate"]),
    "reward never returns": (
        lambda t: ["--plugin", FAULTY, "--fault", "reward-hangs", "--reward-timeout", "1"],
        ["4 of 4 samples failed to be scored", "slime_reward: TimeoutError: no answer within --reward-timeout 1s"]),
    "reward blocks the event loop": (
        lambda t: ["--plugin", FAULTY, "--fault", "reward-blocks", "--rollout-timeout", "20"],
        # (other calls may be in flight beside the blocked reward, named in any order)
        ["rollout 0 (--rollout-timeout) did not finish within 20 s: waiting on ",
         "plugin 'faulty_plugin' slime_reward for sample", "The event loop has not turned for", "faulty_plugin.py:", "in slime_reward",
         "await asyncio.to_thread", "process RolloutManager.generate"]),
    "filter drops every group": (
        lambda t: ["--plugin", FAULTY, "--fault", "drop-all", "--max-filter-rounds", "3"],
        ["group filters dropped", "groups in 3 over-sampling rounds and accepted 0 of 2",
         "plugin 'faulty_plugin' dropped", "(never_good_enough)", "raise --max-filter-rounds"]),
    "plugin fails to import in a Ray worker": (
        _import_fails_in_workers,
        ["driver_only.py' (file", "failed to import: ImportError: No module named 'gpu_only_dep'",
         # the rollout manager and the train ranks start side by side: whichever imports the plugin first reports
         "Fix the error in the plugin", "It loads in the driver (which checked it before Ray started) but not in "
         "this Ray worker (host", ("process RolloutManager.__init__", "process TrainActor.__init__")]),
}


@pytest.mark.parametrize("case", list(IN_RUN))
def test_a_fault_inside_the_run_stops_it_with_the_original_message(case, tiny_checkpoint, tmp_path):
    make_args, expected = IN_RUN[case]
    proc, seconds, stderr = _train(_args(tiny_checkpoint, tmp_path, *make_args(tmp_path)), timeout(120))
    assert proc.returncode in (1, 2), proc.stderr[-4000:]
    last = " ".join(proc.stderr[proc.stderr.rindex("\nerror:"):].split())  # the one message, printed at the end
    for text in expected:  # a tuple: any one of them
        assert any(t in last for t in (text if isinstance(text, tuple) else (text,))), (text, proc.stderr[-4000:])
    assert "UnserializableException" not in stderr
    if case == "plugin fails to import in a Ray worker":
        # the driver says it once; a worker prints no traceback of the plugin's import (Ray itself still echoes
        # each failed actor constructor's error, a few lines per actor)
        assert proc.stderr.count("\nerror:") == 1 and 'driver_only.py", line' not in proc.stderr, proc.stderr[-6000:]
    assert seconds < timeout(120), f"{case}: failed after {seconds:.1f}s"


class _RewardServer:
    """A reward service on 127.0.0.1 (aiohttp, on a thread of the test process) that answers every request
    with HTTP 500, or with a 200 whose body is not JSON; it counts the requests it got."""

    ANSWERS = {"500": (500, "internal error: the judge model is down"), "junk": (200, "<html>busy</html>")}

    def __init__(self, mode: str):
        import asyncio
        import threading

        from aiohttp import web

        from slimecore.engines.router import free_port

        self.port, self.requests = free_port(), 0
        self.url = f"http://127.0.0.1:{self.port}/reward"
        status, body = self.ANSWERS[mode]

        async def reward(request):
            await request.json()
            self.requests += 1
            return web.Response(status=status, text=body)

        app = web.Application()
        app.router.add_post("/reward", reward)
        self.loop, started = asyncio.new_event_loop(), threading.Event()

        def serve():
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            self.runner = runner
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(runner.cleanup())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(timeout(30)), "the reward server did not start"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout(30))


REMOTE_REWARD = {  # mode: (what the message says, attempts per sample)
    "500": (["failed after 3 attempt(s) (--rm-max-retries); last error: HTTP 500: internal error: the judge model "
             "is down"], 3),
    "junk": (["answered 200 with a body that is not JSON: '<html>busy</html>'", "must answer a JSON number or object"],
             1),
}


@pytest.mark.parametrize("mode", list(REMOTE_REWARD))
def test_a_remote_reward_server_answering_errors_fails_the_run(mode, tiny_checkpoint, tmp_path):
    """A real run whose --rm-url answers HTTP 500 (retried with backoff, then failed) or junk (not retried):
    every sample is marked FAILED, the run stops at its first step with the URL and what was wrong, and no
    step trains on reward 0."""
    server = _RewardServer(mode)
    try:
        args = ["--prompt-data", _jsonl(tmp_path / "d.jsonl", ROWS), "--label-key", "label", "--rm-type", "remote_rm",
                "--rm-url", server.url, "--rm-max-retries", "3", "--rm-retry-delay", "0.05"]
        proc, seconds, _ = _train(_args(tiny_checkpoint, tmp_path, *args), timeout(120))
    finally:
        server.stop()
    assert proc.returncode == 1, proc.stderr[-4000:]
    last = " ".join(proc.stderr[proc.stderr.rindex("\nerror:"):].split())
    expected, attempts = REMOTE_REWARD[mode]
    for text in ["4 of 4 samples failed to be scored", f"remote_rm: POST {server.url}", *expected]:
        assert text in last, (text, last)
    assert server.requests == 4 * attempts  # 2 prompts x 2 samples, each tried `attempts` times
    early = f"remote_rm: POST {server.url} -> HTTP 500: 'internal error: the judge model is down'; retrying 2 more"
    assert proc.stderr.count(early) == (attempts > 1), proc.stderr[-4000:]  # said once, at the first failed attempt
    assert "Traceback" not in proc.stderr  # each failure is the service's answer, said once, not our stack
    metrics = tmp_path / "log" / "metrics.jsonl"
    assert not (metrics.is_file() and metrics.read_text().strip())  # no step was trained
    assert seconds < timeout(120)


# -- clean ends ----------------------------------------------------------------------------------------


def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries ``mark``: the run's driver and everything it started (Ray's
    processes, the actors, the router) inherit it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_mid_run_stops_everything_within_15s(tiny_checkpoint, tmp_path):
    mark = f"SLIMECORE_TEST_RUN_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    assert _marked_processes(mark) == []
    shm_before = torch_shm_files()
    log = tmp_path / "log" / "metrics.jsonl"
    proc = subprocess.Popen(_args(tiny_checkpoint, tmp_path, "--task", "compare", "--num-rollout", "1000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, key: value})
    try:
        deadline = time.monotonic() + timeout(180)
        while not (log.is_file() and log.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and log.is_file(), "the run did not reach its first step"
        running = _marked_processes(mark)
        assert len(running) > 3  # the driver, Ray's own processes, the rollout manager, engines, trainer, router
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=timeout(60))
        seconds = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "interrupted (SIGTERM): the step in flight was abandoned" in " ".join(stderr.split())
    assert stderr.rstrip().splitlines()[-1].startswith("interrupted (SIGTERM)"), stderr[-3000:]  # nothing after it
    assert seconds < timeout(15), f"exited {seconds:.1f}s after SIGTERM"
    time.sleep(1)  # processes reparented to init are reaped asynchronously
    left = _marked_processes(mark)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left if Path(f"/proc/{p}").exists()]
    assert not shm_left_behind(shm_before), "the trainer's weights stayed in /dev/shm"


def test_two_runs_side_by_side_do_not_collide(tiny_checkpoint, tmp_path):
    """Two ``slime-core train`` processes at once, each starting its own Ray (its own ports, engines and
    router on free ports): both finish with their own metrics; a third given the first one's --log-dir stops
    before Ray starts, naming the run that holds it."""
    runs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        runs.append(subprocess.Popen(_args(tiny_checkpoint, folder, "--task", "compare", "--log-samples", "0"),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        lock = tmp_path / "a" / "log" / LOCK_FILE
        deadline = time.monotonic() + timeout(60)
        while not lock.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        # its pre-Ray checks share 2 cores with both runs here: only the outcome is asserted, not their speed
        third, _, stderr = _train(_args(tiny_checkpoint, tmp_path / "a"), timeout(120))
        assert third.returncode == 2 and f"is in use by another run (pid {runs[0].pid})" in stderr, stderr[-2000:]
        assert "Started a local Ray instance" not in stderr
        errors = [run.communicate(timeout=timeout(300))[1] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    for run, err in zip(runs, errors):
        assert run.returncode == 0, err[-4000:]
        assert "Started a local Ray instance" in err  # each its own
    for name in ("a", "b"):
        steps = [json.loads(line) for line in (tmp_path / name / "log" / "metrics.jsonl").read_text().splitlines()]
        assert [m["rollout/step"] for m in steps] == [0, 1]
