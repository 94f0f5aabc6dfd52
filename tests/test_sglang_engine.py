"""``--rollout-engine sglang`` end to end with the CPU stand-in for ``sglang.launch_server``
(``slimecore.testing.sglang_standin``): spawn, /health_generate wait, router registration, weight sync
(tensor and distributed), memory release/resume, API key, shutdown. Server arguments are checked against
the installed sglang's ServerArgs before Ray starts."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from slimecore.config import ConfigError, parse_config
from slimecore.engines import sglang as sglang_engine
from slimecore.sglang_schema import sglang_root

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
needs_sglang = pytest.mark.skipif(sglang_root() is None, reason="the sglang wheel is not installed (scripts/setup.sh)")
STANDIN = "python -m slimecore.testing.sglang_standin"
BASE = ["--rollout-batch-size", "2", "--rollout-engine", "sglang"]


def _train(checkpoint: Path, log_dir: Path, *extra: str) -> list[dict]:
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint", str(checkpoint),
            "--task", "compare", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8", "--lr", "1e-4", "--log-dir", str(log_dir), "--no-use-tensorboard",
            "--rollout-engine", "sglang", "--sglang-launch-command", STANDIN, "--sglang-mem-fraction-static", "0.7",
            "--sglang-startup-timeout", "300", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _served_urls(log_dir: Path) -> list[str]:
    logs = sorted((log_dir / "engines").glob("engine-*.log"))
    return [re.search(r"ready at (\S+)", path.read_text()).group(1) for path in logs]


def _closed(url: str) -> bool:
    parsed = urlparse(url)
    with socket.socket() as s:
        return s.connect_ex((parsed.hostname, parsed.port)) != 0


@needs_sglang
def test_colocated_run_syncs_through_tensors_and_releases_engine_memory(tiny_checkpoint, tmp_path):
    log_dir = tmp_path / "co"
    steps = _train(tiny_checkpoint, log_dir, "--num-rollout", "2", "--colocate")
    assert [m["rollout/step"] for m in steps] == [0, 1]
    assert all(m["perf/update_weights_time"] > 0 for m in steps)  # released weights are pushed back every step
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # the stand-in serves the trainer's weights
    log = (log_dir / "engines" / "engine-0.log").read_text()
    assert "'mem_fraction_static': '0.7'" in log and "'enable_memory_saver': True" in log  # flags reached it
    urls = _served_urls(log_dir)
    assert len(urls) == 1 and all(_closed(u) for u in urls)  # shut down with the run


@needs_sglang
def test_disaggregated_run_syncs_by_broadcast_with_an_api_key(tiny_checkpoint, tmp_path):
    log_dir = tmp_path / "dis"
    steps = _train(tiny_checkpoint, log_dir, "--num-rollout", "2", "--rollout-num-gpus", "2",
                   "--update-weight-transport", "distributed", "--rollout-host", "127.0.0.2")
    assert len(steps) == 2 and steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    urls = _served_urls(log_dir)
    assert len(urls) == 2 and all(urlparse(u).hostname == "127.0.0.2" for u in urls)
    assert "'api_key'" not in (log_dir / "engines" / "engine-0.log").read_text()  # used, never printed
    assert all(_closed(u) for u in urls)


def test_engine_startup_failure_shows_the_server_log(tiny_checkpoint, tmp_path):
    import ray

    from slimecore.engines.sglang import SGLangEngineActor

    config = parse_config(BASE + ["--hf-checkpoint", str(tiny_checkpoint), "--sglang-launch-command",
                                  "python -c \"import sys; print('no GPU here'); sys.exit(3)\""], [], {})
    ray_before = ray.is_initialized()  # an earlier test of this process may have left Ray running
    actor = SGLangEngineActor(config.to_dict(), 0, log_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*no GPU here"):
        actor.start()
    assert ray.is_initialized() == ray_before  # the actor class runs (and fails) without starting Ray


def test_server_args_are_slimes_then_the_users(tiny_checkpoint, tmp_path):
    yaml_file = tmp_path / "sglang.yaml"
    yaml_file.write_text("mem_fraction_static: 0.6\nchunked-prefill-size: 4096\n")
    config = parse_config(BASE + ["--hf-checkpoint", str(tiny_checkpoint), "--sglang-mem-fraction-static", "0.8",
                                  "--sglang-enable-metrics", "--sglang-config", str(yaml_file),
                                  "--rollout-num-gpus-per-engine", "2", "--colocate", "--seed", "7"], [], {})
    args = sglang_engine.server_args(config, 1, base_gpu_id=2, host="10.0.0.5", port=30001, api_key="-k")
    assert args == {"model_path": str(tiny_checkpoint), "tp_size": 2, "base_gpu_id": 2, "host": "10.0.0.5",
                    "port": 30001, "random_seed": 8, "skip_server_warmup": True, "enable_memory_saver": True,
                    "api_key": "-k", "mem_fraction_static": 0.6, "enable_metrics": True, "chunked_prefill_size": 4096}
    line = sglang_engine.command_line(config, args)
    assert line[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert line[line.index("--tp-size") + 1] == "2" and "--enable-metrics" in line and "--enable-memory-saver" in line
    assert "--api-key=-k" in line  # a random key may start with "-": joined, argparse takes it as the value
    # the CPU stand-in reads the line as SGLang's argparse does, a key starting with "--" too (1 in 4096 random keys)
    from slimecore.testing.sglang_standin import parse

    parsed = parse(sglang_engine.command_line(config, {**args, "api_key": "--k=1"})[3:])
    assert parsed["api_key"] == "--k=1" and parsed["port"] == "30001" and parsed["enable_metrics"] is True


@needs_sglang
@pytest.mark.parametrize("flag, message", [
    (["--sglang-mem-fraction-statik", "0.7"], r"no field 'mem_fraction_statik'; did you mean 'mem_fraction_static'"),
    (["--sglang-tp-size", "2"], r"sets tp_size itself from --rollout-num-gpus-per-engine"),
    (["--sglang-port", "3000"], r"sets port itself"),
])
def test_unknown_or_owned_server_args_fail_before_ray(flag, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(BASE + flag, [], {})


@needs_sglang
def test_sglang_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("not_a_server_arg: 1\n")
    with pytest.raises(ConfigError, match=rf"from --sglang-config {re.escape(str(bad))}.*not_a_server_arg"):
        parse_config(BASE + ["--sglang-config", str(bad)], [], {})
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(BASE + ["--sglang-config", str(tmp_path / "missing.yaml")], [], {})


def test_core_options_with_the_sglang_prefix_are_not_server_args():
    config = parse_config(BASE + ["--sglang-server-concurrency", "64", "--sglang-startup-timeout", "5"], [], {})
    assert config.sglang_server_concurrency == 64 and config.sglang_startup_timeout == 5
    assert config.sglang_args == {}
