"""A Ray cluster of two nodes on this machine (two raylets: ``ray start --head`` and ``ray start --address``,
each with its own custom resource), joined by ``slime-core train --ray-address`` and by ``ray job submit``
as the README shows. Engines go to one node and trainers to the other. Every Ray process the test starts
runs in its own process group with explicit free ports, and the test stops exactly those processes
(never ``ray stop``, which would end every Ray instance on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
psutil = pytest.importorskip("psutil")

from slimecore.testing import timeout  # noqa: E402


WORKER_IP = "127.0.0.2"  # the second node's own address (a loopback one: Linux routes all of 127.0.0.0/8 to lo)
HERE = Path(__file__).parent


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _node_ports() -> list[str]:
    manager, objects, agent_listen, agent_grpc, metrics, runtime_env, low = _free_ports(7)
    return ["--node-manager-port", str(manager), "--object-manager-port", str(objects),
            "--dashboard-agent-listen-port", str(agent_listen), "--dashboard-agent-grpc-port", str(agent_grpc),
            "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
            "--min-worker-port", str(low), "--max-worker-port", str(low + 40)]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")  # slime-core for job entrypoints
    return env


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the ``ray start --block`` process group and every process it spawned, then SIGKILL survivors."""
    try:
        family = [process.pid] + [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = [process.pid]
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + 20
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                         for p in family):
        time.sleep(0.2)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=10)


def _cluster_nodes(address: str) -> list[dict]:
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps([n for n in ray.nodes() if n['Alive']])); ray.shutdown()" % address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout(120),
                         env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_node_cluster():
    gcs, dashboard, client = _free_ports(3)
    temp_dir = tempfile.mkdtemp(prefix="slrc", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_cli = str(Path(sys.executable).parent / "ray")
    common = ["--block", "--num-cpus", "2", "--disable-usage-stats"]
    head = subprocess.Popen([ray_cli, "start", "--head", "--port", str(gcs), "--ray-client-server-port", str(client),
                             "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(dashboard), "--temp-dir", temp_dir,
                             "--object-store-memory", str(200 << 20), "--resources", '{"trainer": 2}',
                             "--node-ip-address", "127.0.0.1", *common, *_node_ports()],
                            env=_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes = [head]
    try:
        address = f"127.0.0.1:{gcs}"
        deadline = time.time() + timeout(120)
        while socket.socket().connect_ex(("127.0.0.1", gcs)) != 0:
            assert head.poll() is None and time.time() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        worker = subprocess.Popen([ray_cli, "start", "--address", address, "--object-store-memory", str(200 << 20),
                                   "--resources", '{"rollout": 2}', "--node-ip-address", WORKER_IP, *common,
                                   *_node_ports()],
                                  env=_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        processes.append(worker)
        while len(nodes := _cluster_nodes(address)) < 2:
            assert worker.poll() is None and time.time() < deadline, "the second raylet did not join"
            time.sleep(1)
        yield {"address": address, "dashboard": f"http://127.0.0.1:{dashboard}",
               "node_of": {r: n["NodeID"] for n in nodes for r in ("trainer", "rollout") if r in n["Resources"]},
               "addresses": {n["NodeManagerAddress"] for n in nodes}}
    finally:
        for process in reversed(processes):
            _stop(process)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _train_args(checkpoint: Path, log_dir: Path) -> list[str]:
    return ["slime-core", "train", "--plugin", "grpo", "--hf-checkpoint", str(checkpoint), "--task", "compare",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
            "--num-rollout", "2", "--log-dir", str(log_dir), "--no-use-tensorboard",
            "--actor-resources", '{"trainer": 1}', "--rollout-resources", '{"rollout": 1}']


def _actor_nodes(cluster: dict, class_name: str) -> set[str]:
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), "list", "actors", "--address",
                          cluster["dashboard"], "--filter", f"class_name={class_name}", "--format", "json",
                          "--limit", "100"], capture_output=True, text=True, timeout=timeout(120), env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return {a["node_id"] for a in json.loads(out.stdout)}


def _steps(log_dir: Path) -> list[int]:
    return [json.loads(line)["rollout/step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_joins_a_two_node_cluster_engines_on_one_node_trainers_on_the_other(two_node_cluster, tiny_checkpoint,
                                                                                   tmp_path):
    args = _train_args(tiny_checkpoint, tmp_path / "run")
    args[0:1] = [sys.executable, "-m", "slimecore_cli"]
    addresses = tmp_path / "addresses.json"
    proc = subprocess.run([*args, "--ray-address", two_node_cluster["address"], "--plugin",
                           str(HERE / "address_plugin.py"), "--address-log", str(addresses)],
                          capture_output=True, text=True, timeout=timeout(300), env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert _steps(tmp_path / "run") == [0, 1]
    assert _actor_nodes(two_node_cluster, "TrainActor") == {two_node_cluster["node_of"]["trainer"]}
    assert _actor_nodes(two_node_cluster, "EmbeddedEngineActor") == {two_node_cluster["node_of"]["rollout"]}
    # the engines bound their own node's address, the router its node's (the head registers this host's
    # address even when started with --node-ip-address 127.0.0.1); the run's key guards both
    seen = json.loads(addresses.read_text())
    assert WORKER_IP in two_node_cluster["addresses"]
    assert {urlparse(url).hostname for url in seen["engines"]} == {WORKER_IP}, seen
    assert seen["engines_listen_on"] == [WORKER_IP], seen  # bound there: a 127.0.0.1 socket is not reached at it
    # the router reached them there: it registered exactly those URLs, and every step's samples came through it
    assert urlparse(seen["router"]).hostname in two_node_cluster["addresses"], seen
    assert seen["keyed"] and seen["engine_without_key"] == 401 and seen["router_without_key"] == 401, seen
    # the run joined the cluster: no local Ray instance was started beside it
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_ray_job_submit_as_in_the_readme(two_node_cluster, tiny_checkpoint, tmp_path):
    ray_cli = str(Path(sys.executable).parent / "ray")
    proc = subprocess.run([ray_cli, "job", "submit", "--address", two_node_cluster["dashboard"], "--",
                           *_train_args(tiny_checkpoint, tmp_path / "job")], capture_output=True, text=True,
                          timeout=timeout(300), env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "succeeded" in proc.stdout
    assert _steps(tmp_path / "job") == [0, 1]


def test_a_placement_the_joined_cluster_cannot_hold_fails_at_once(two_node_cluster, tiny_checkpoint, tmp_path):
    """On a cluster it joins, the run checks its placement once Ray is up (the cluster's resources are known
    only then): one message naming the resource, within seconds of joining, instead of a placement wait."""
    args = _train_args(tiny_checkpoint, tmp_path / "run")
    args[0:1] = [sys.executable, "-m", "slimecore_cli"]
    start = time.monotonic()
    proc = subprocess.run([*args, "--ray-address", two_node_cluster["address"], "--rollout-resources",
                           '{"rollout": 3}'], capture_output=True, text=True, timeout=timeout(120), env=_env())
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = " ".join(proc.stderr[proc.stderr.rindex("\nerror:"):].split())
    assert "the cluster cannot hold this run" in last and "need 3 rollout (the cluster has 2)" in last, last
    assert "Traceback" not in proc.stderr
    assert elapsed < timeout(30), elapsed
