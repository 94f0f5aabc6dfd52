"""The real sglang-router (``python -m sglang_router.launch_router``) in front of the engines.

Readiness is ``GET /readiness`` reporting every worker healthy: the router's ``/health`` answers 200
before any worker has registered, so it proves nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _die_with_parent() -> None:
    """Linux: the router gets SIGTERM when the process that started it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Router:
    def __init__(self, worker_urls: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
                 port: int | None = None, startup_timeout: float = 120, log_dir: str | None = None):
        self.worker_urls, self.policy, self.host = list(worker_urls), policy, host
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="slimecore-router-")) / f"router-{self.port}.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Router":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
                "--policy", self.policy, "--log-level", "warn", "--prometheus-port", str(free_port()),
                "--worker-startup-timeout-secs", str(int(self.startup_timeout)), "--health-check-interval-secs", "60"]
        if self.worker_urls:
            args += ["--worker-urls", *self.worker_urls]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        self.wait_ready(len(self.worker_urls))
        return self

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, workers: int) -> None:
        deadline = time.time() + self.startup_timeout
        healthy = -1
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                status, body = _http("GET", self.url + "/readiness", timeout=2)
                if body:
                    healthy = json.loads(body).get("healthy_workers", -1)
                    if status == 200 and healthy >= workers:
                        return
            except (OSError, ValueError):
                pass  # not listening yet
            time.sleep(0.2)
        registered = self.list_workers() if self.process.poll() is None else []
        missing = [u for u in self.worker_urls if u not in registered]
        self.stop()
        raise TimeoutError(f"sglang-router at {self.url} had {max(healthy, 0)}/{workers} healthy workers after "
                           f"{self.startup_timeout:.0f}s; not registered: {missing}. Check that each engine answers "
                           f"GET /health. Router log tail:\n{self.log_tail()}")

    def list_workers(self) -> list[str]:
        try:
            status, body = _http("GET", self.url + "/workers", timeout=5)
        except OSError:
            return []
        if status != 200:
            return []
        data = json.loads(body)
        workers = data.get("workers", data) if isinstance(data, dict) else data
        return [w.get("url") if isinstance(w, dict) else w for w in workers]

    def add_worker(self, url: str) -> None:
        status, body = _http("POST", self.url + "/workers", {"url": url})
        if status >= 300:
            raise RuntimeError(f"router refused worker {url}: HTTP {status} {body[:200]!r}")
        self.worker_urls.append(url)
        self.wait_ready(len(self.worker_urls))

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()
