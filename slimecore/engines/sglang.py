"""``--rollout-engine sglang``: one Ray actor per engine, each running SGLang's HTTP server as a subprocess.

The actor sits in the placement bundle of the engine's first GPU (``slimecore.raytools.gpu_placement``)
and starts ``--sglang-launch-command`` (default ``python -m sglang.launch_server``) with SGLang's
``ServerArgs`` as ``--<field>`` flags:

- set here, as slime does: ``model_path`` (``--hf-checkpoint``), ``tp_size``
  (``--rollout-num-gpus-per-engine``), ``base_gpu_id`` (the GPU Ray gave the actor), ``host``, ``port`` (a
  free one), ``random_seed`` (``--seed`` + engine index), ``enable_memory_saver`` (``--offload-rollout``),
  ``skip_server_warmup``, ``enable_return_routed_experts`` (``--use-rollout-routing-replay``), and ``api_key`` on
  a multi-node run;
- then every ``--sglang-<field> VALUE``, then the ``--sglang-config`` YAML mapping, under SGLang's own
  field names. An unknown field, or one of the fields above, is a start-up error (checked against the
  installed sglang's ``ServerArgs`` before Ray starts).

It waits for ``/health_generate`` (``--sglang-startup-timeout``; the error shows the server log's tail) and
stops the server's whole process group on shutdown. The sglang package is needed only where the server
runs (the ``[sglang]`` extra); nothing here imports it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slimecore.config import Config
from slimecore.engines.router import option
from slimecore.sglang_schema import overrides

def server_args(config: Config, index: int, base_gpu_id: int, host: str, port: int,
                api_key: str | None = None) -> dict:
    """The ``ServerArgs`` of engine ``index`` (module docstring)."""
    args = {"model_path": config.hf_checkpoint, "tp_size": config.rollout_num_gpus_per_engine,
            "base_gpu_id": base_gpu_id, "host": host, "port": port, "random_seed": config.seed + index,
            "skip_server_warmup": True}
    if config.offload_rollout:
        args["enable_memory_saver"] = True
    if config.use_rollout_routing_replay:
        args["enable_return_routed_experts"] = True
    if api_key:
        args["api_key"] = api_key
    args.update(overrides(config))
    return args


def command_line(config: Config, args: dict) -> list[str]:
    """``--sglang-launch-command`` followed by ``args`` as SGLang's CLI flags (a true bool is a bare flag,
    false/None are left out, a list gives several values, a mapping is JSON). A value that starts with ``-``
    (a negative number, an API key) is joined to its flag, ``--flag=value``, so argparse takes it as the value."""
    command = shlex.split(config.sglang_launch_command)
    if command and command[0] == "python":
        command[0] = sys.executable
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)]
        elif isinstance(value, dict):
            command += [flag, json.dumps(value)]
        else:
            command += option(flag, str(value))
    return command



class SGLangEngineActor:
    """One SGLang server (``start`` returns its URL once ``/health_generate`` answers 200)."""

    def __init__(self, config_dict: dict, index: int, host: str = "127.0.0.1", api_key: str | None = None,
                 log_dir: str | None = None):
        self.config = Config.from_dict(config_dict)
        if host == "node":  # a run spanning nodes: bind this node's own address, as Ray knows it
            from slimecore.raytools import node_address

            host = node_address()
        self.index, self.host, self.api_key = index, host, api_key
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="slimecore-sglang-")) / f"engine-{index}.log"
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> str:
        from slimecore.engines.router import free_port, spawn_logged
        from slimecore.raytools import local_gpu

        port = free_port(self.host)
        args = server_args(self.config, self.index, local_gpu() or 0, self.host, port, self.api_key)
        self.url = f"http://{self.host}:{port}"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"  # /health answers at once (slime does the same)
        self.process, self._log = spawn_logged(command_line(self.config, args), self.log_path, env)
        try:
            self._wait_healthy(self.config.sglang_startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        return self.url

    def _wait_healthy(self, timeout: float) -> None:
        from slimecore.engines.router import http_request

        deadline = time.time() + timeout
        last = "no answer yet"
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang engine {self.index} exited with code {self.process.returncode} before "
                                   f"it served {self.url}; log {self.log_path}, tail:\n{self.log_tail()}")
            try:
                status, _ = http_request("GET", self.url + "/health_generate", timeout=30, api_key=self.api_key)
                if status == 200:
                    return
                last = f"HTTP {status}"
            except OSError as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            time.sleep(1)
        raise TimeoutError(f"SGLang engine {self.index} at {self.url} did not answer /health_generate with 200 "
                           f"within {timeout:.0f}s (--sglang-startup-timeout; last: {last}); log {self.log_path}, "
                           f"tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        from slimecore.engines.router import log_tail

        return log_tail(self.log_path, lines)

    def health(self, timeout: float = 5) -> bool:
        """``/health_generate`` answers 200 within ``timeout`` seconds."""
        from slimecore.engines.router import http_request

        if self.process is None or self.process.poll() is not None:
            return False
        try:
            return http_request("GET", self.url + "/health_generate", timeout=timeout, api_key=self.api_key)[0] == 200
        except OSError:
            return False

    def shutdown(self) -> None:
        """Stop the server and everything it started (its own process group)."""
        from slimecore.engines.router import stop_process_group

        stop_process_group(self.process, getattr(self, "_log", None), timeout=30)
        self._log = None
