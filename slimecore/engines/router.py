"""The real sglang-router in front of the engines, in a process of its own (``router_process``: what
``python -m sglang_router.launch_router`` runs, minus its Python load balancer's imports).

Readiness is ``GET /readiness`` reporting every worker healthy: the router's ``/health`` answers 200
before any worker has registered, so it proves nothing. Workers are added with ``POST /workers``
(202, registered in the background) and removed with ``DELETE /workers/{id}``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slimecore.http_client import http_json, http_request  # noqa: F401 (importable from here too)

log = logging.getLogger("slimecore.router")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it); every process that needs one to listen on asks here."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _probe(url: str) -> str:
    """What a worker's ``GET /health`` says, for error messages."""
    try:
        status, _ = http_request("GET", url + "/health", timeout=2)
    except OSError as exc:
        return f"GET {url}/health failed: {getattr(exc, 'reason', exc)}"
    return f"GET {url}/health -> HTTP {status}"


def _die_with_parent() -> None:
    """Linux: the router gets SIGTERM when the process that started it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def option(flag: str, value: str) -> list[str]:
    """``[flag, value]``, or ``[flag=value]`` when ``value`` starts with ``-`` (argparse would read it as a flag)."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


def spawn_logged(args: list[str], log_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, object]:
    """Start a server in its own process group (so stopping it stops its children), stdout and stderr
    appended to ``log_path``; it gets SIGTERM if this process dies. Returns (process, open log file)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                               preexec_fn=_die_with_parent)
    return process, log


def log_tail(log_path: Path, lines: int = 20) -> str:
    """The last lines of a server log, without terminal colour codes."""
    if not log_path.is_file():
        return ""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))
    return "\n".join(text.splitlines()[-lines:])


def stop_process_group(process: subprocess.Popen | None, log=None, timeout: float = 10) -> None:
    """SIGTERM the process's group, SIGKILL it after ``timeout`` seconds; close its log."""
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
    if log is not None:
        log.close()


class Router:
    """One sglang-router subprocess (own process group, killed on ``stop``), logging to ``log_path``.

    ``Router(urls).start()`` returns once ``/readiness`` reports every worker healthy, or raises
    TimeoutError naming the workers that are not, with their ``/health`` answers and the log tail.

    ``external=True``: a router someone else runs at ``host:port`` (slime's ``--sglang-router-ip/port``): no
    process is started or killed; ``stop`` takes this run's workers out of it again."""

    def __init__(self, worker_urls: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
                 port: int | None = None, startup_timeout: float = 120, log_dir: str | None = None,
                 health_check_interval: int = 60, api_key: str | None = None, external: bool = False):
        self.worker_urls, self.policy, self.host, self.external = list(worker_urls), policy, host, external
        # the router's --api-key: clients must send it, and the router sends it to the workers (SGLang's --api-key)
        self.api_key = api_key
        self.port = port or free_port()
        self.startup_timeout, self.health_check_interval = startup_timeout, health_check_interval
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="slimecore-router-")) / f"router-{self.port}.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Router:
        """Start the router and return once ``/readiness`` reports every worker healthy (see the class)."""
        self.spawn()
        try:
            self.wait_ready(len(self.worker_urls))
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> Router:
        """Start the router's process and return at once (``start`` waits for it): a router spawned with no
        workers while the engines load is up when they are, and takes them with ``add_worker``."""
        if self.external:
            return self
        args = [sys.executable, "-m", "slimecore.engines.router_process", "--host", self.host, "--port", str(self.port),
                "--policy", self.policy, "--log-level", "warn", "--prometheus-port", str(free_port()),
                "--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout))),
                "--health-check-interval-secs", str(self.health_check_interval)]
        if self.worker_urls:
            args += ["--worker-urls", *self.worker_urls]
        if self.api_key:
            args += option("--api-key", self.api_key)  # a random key may start with "-"
        self.process, self._log = spawn_logged(args, self.log_path)
        return self

    @property
    def running(self) -> bool:
        """Its process was started and has not exited (an external router: assumed up, requests tell)."""
        return self.external or (self.process is not None and self.process.poll() is None)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the router's log, without its terminal colour codes."""
        return log_tail(self.log_path, lines)

    def wait_ready(self, workers: int, timeout: float | None = None) -> None:
        """Block until ``/readiness`` reports at least ``workers`` healthy workers (for 0 workers, until
        the router answers at all: its readiness is 503 without workers)."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.time() + timeout
        healthy = 0
        while time.time() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode}; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                status, body = http_request("GET", self.url + "/readiness", timeout=2, api_key=self.api_key)
                if workers == 0:
                    return
                healthy = json.loads(body).get("healthy_workers", 0) if body else 0
                if status == 200 and healthy >= workers:
                    return
            except (OSError, ValueError):
                pass  # the router is not listening yet, or answered before it could report JSON
            time.sleep(0.1)
        registered = self.list_workers()
        failed = [f"{u} ({'registered' if u in registered else 'not registered'}; {_probe(u)})"
                  for u in self.worker_urls]
        raise TimeoutError(f"sglang-router at {self.url} had {healthy}/{workers} healthy workers after "
                           f"{timeout:.0f}s. "
                           f"Workers: {'; '.join(failed)}. Each engine must answer GET /health with 200. "
                           f"Router log tail:\n{self.log_tail()}")

    def workers(self) -> list[dict]:
        """``GET /workers``: the router's worker records (``url``, ``id``, health, ...); [] if unreachable."""
        try:
            status, body = http_request("GET", self.url + "/workers", timeout=5, api_key=self.api_key)
        except OSError:
            return []
        if status != 200:
            return []
        data = json.loads(body)
        records = data.get("workers", []) if isinstance(data, dict) else data
        return [r if isinstance(r, dict) else {"url": r} for r in records]

    def list_workers(self) -> list[str]:
        """The URLs of the registered workers."""
        return [r["url"] for r in self.workers()]

    def add_worker(self, url: str, timeout: float | None = None) -> None:
        """Register a worker and wait until the router reports it healthy."""
        record = {"url": url, "api_key": self.api_key} if self.api_key else {"url": url}
        status, body = http_request("POST", self.url + "/workers", record, api_key=self.api_key)
        if status >= 300:
            raise RuntimeError(f"router refused worker {url}: HTTP {status} {body[:200]!r}")
        self.worker_urls.append(url)
        self.wait_ready(len(self.worker_urls), timeout)

    def remove_worker(self, url: str, timeout: float = 30) -> None:
        """Deregister a worker (``DELETE /workers/{id}``) and wait until the router no longer lists it."""
        ids = [r.get("id") for r in self.workers() if r["url"] == url]
        if not ids:
            raise ValueError(f"{url} is not a worker of the router at {self.url}; it has {self.list_workers()}")
        status, body = http_request("DELETE", f"{self.url}/workers/{ids[0]}", api_key=self.api_key)
        if status >= 300:
            raise RuntimeError(f"router refused to remove worker {url}: HTTP {status} {body[:200]!r}")
        deadline = time.time() + timeout
        while url in self.list_workers():
            if time.time() > deadline:
                raise TimeoutError(f"the router still lists {url} {timeout:.0f}s after DELETE /workers/{ids[0]}")
            time.sleep(0.1)
        if url in self.worker_urls:
            self.worker_urls.remove(url)

    def restart(self) -> Router:
        """Start the router again on the same port with the current workers (after its process died), so
        clients keep their URL."""
        if self.external:
            raise RuntimeError(f"the external sglang-router at {self.url} (--sglang-router-ip/port) stopped answering; "
                               "slime-core does not restart a router it did not start")
        self.stop()
        return self.start()

    def stop(self) -> None:
        if self.external:  # leave the router as it was: without this run's engines
            for url in list(self.worker_urls):
                try:
                    self.remove_worker(url, timeout=10)
                except (OSError, ValueError, RuntimeError, TimeoutError) as exc:
                    log.warning("could not take %s out of the external router at %s: %s", url, self.url, exc)
            return
        stop_process_group(self.process, getattr(self, "_log", None))
