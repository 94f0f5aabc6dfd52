"""Session fixtures: the tiny checkpoint, Ray, and embedded engines behind the real router.

Fixtures: ``tiny_checkpoint`` (session; a tiny Qwen2 directory), ``ray_session`` (session; a local
Ray), ``embedded_engine`` (module; one EmbeddedServer, no router), ``engines`` (module; two
EmbeddedServers behind one real sglang-router, yields ``(servers, router)``). ``http_json`` is a
plain helper for tests that talk HTTP directly.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slimecore.testing.tiny import make_tiny_checkpoint


def http_json(method: str, url: str, body=None, timeout: float = 60):
    """(status, decoded JSON body or raw text or None) of one HTTP call; HTTP errors are returned."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode()


def torch_shm_files() -> set[str]:
    """torch's shared-memory files (``/dev/shm/torch_<pid>_...``: a trainer's weights, one per rank while a run
    lasts)."""
    return {p.name for p in Path("/dev/shm").glob("torch_*")}


def shm_left_behind(before: set[str]) -> set[str]:
    """The torch files made since ``before`` whose making process is gone: what a run that ended left in /dev/shm.
    Files of processes still running (another test's run, another run on the machine) are not counted."""
    return {name for name in torch_shm_files() - before if not Path(f"/proc/{name.split('_')[1]}").exists()}


def built_once(tmp_path_factory, name: str, build):
    """``build(directory)`` once per test session, returning what it returns. Under pytest-xdist each worker is a
    process with its own session fixtures: the first worker that asks builds in the session's shared temporary
    root, under a file lock, and the others wait for it and take the same result."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    done = root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            done.write_text(str(build(root / name)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # address="local": this test process's own instance, never a cluster another test started with `ray start`
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def embedded_engine(tiny_checkpoint):
    """One embedded engine on threads of this process, reached directly (no router)."""
    from slimecore.testing.engines import embedded_engine

    with embedded_engine(tiny_checkpoint, max_batch_size=8) as server:
        yield server


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """Two embedded engines on threads of this process, behind one real sglang-router."""
    from slimecore.engines.embedded import EmbeddedServer
    from slimecore.engines.router import Router

    servers = [EmbeddedServer(str(tiny_checkpoint), seed=i) for i in range(2)]
    urls = [s.start() for s in servers]
    router = Router(urls).start()
    yield servers, router
    router.stop()
    for server in servers:
        server.stop()
