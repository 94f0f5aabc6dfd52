"""One folder per run, and reading runs back.

A run writes everything under its folder (``--log-dir``; by default a new ``runs/<date>-<time>-<plugins>/``
with the symlink ``runs/latest`` moved to it):

- ``config.yaml``: the complete resolved config; ``slime-core train --config runs/X/config.yaml`` replays it;
- ``metrics.jsonl``: one record per step (and ``tensorboard/``);
- ``samples.jsonl``: ``--log-samples`` samples per step (prompt, response, reward, status);
- ``final/``: the trained model as an HF checkpoint (``slimecore.export``);
- ``curves.png``: reward, response length, step time and KL by step (``slimecore.plotting``);
- ``summary.json``: written when the run ends (steps, reward first -> last quarter, the whole command's time,
  paths);
- ``command.json``: the command line, the folder it ran in and when it started;
- ``ray-logs``: a link to the Ray session's logs, every actor's full output (what the console leaves out).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from slimecore.config import CORE_BY_NAME, Config, ConfigError

RUNS_ROOT = Path("runs")
COMMAND = "command.json"
RAY_LOGS = "ray-logs"
_IMPORTED = time.time()
LATEST = "latest"
REWARD = "rollout/raw_reward"


def plugin_label(specs: list[str]) -> str:
    """``grpo+search_r1`` from the ``--plugin`` values (a module path or file gives its last name)."""
    names = [re.sub(r"[^A-Za-z0-9_]+", "_", Path(s).stem if s.endswith(".py") else s.rsplit(".", 1)[-1])
             for s in specs]
    return "+".join(names) or "core"


def create_run_dir(config: Config, root: Path = RUNS_ROOT) -> Path:
    """The run's folder: ``--log-dir`` when given, else a new ``root/<date>-<time>-<plugins>/`` (a numeric
    suffix when two runs start in the same second) with ``root/latest`` moved to it atomically. Sets
    ``config.log_dir`` so every process writes there."""
    try:
        if config.log_dir:
            path = Path(config.log_dir)
            path.mkdir(parents=True, exist_ok=True)
            return path
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        flag = f"--log-dir {config.log_dir}" if config.log_dir else f"the run folder's root {root.resolve()}"
        raise ConfigError(f"{flag}: cannot create it ({exc.strerror or exc}); give a --log-dir you can write "
                          "to") from None
    stem = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{plugin_label(config.plugins)}"
    for attempt in range(1, 1000):
        path = root / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            path.mkdir()  # atomic: of two runs racing for one name, exactly one gets it
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{root}: 999 runs named {stem}* already exist")
    _point_latest(root, path.name)
    config.log_dir = str(path.resolve())  # every process, whatever its working directory
    return path


def _point_latest(root: Path, name: str) -> None:
    latest = root / LATEST
    if latest.exists() and not latest.is_symlink():
        # a folder from a version that wrote every run into runs/latest: keep it under its own name
        latest.rename(root / f"{LATEST}-before-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    tmp = root / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    os.replace(tmp, latest)  # readers see the old run or the new one, never no link


def config_yaml(config: Config) -> str:
    """The resolved config as a ``--config`` file: every core option, the plugins, their options (flat, as
    ``--config`` accepts them) and ``sglang``. ``log_dir`` is left out so a replay gets a folder of its own;
    ``global_batch_size`` too when ``num_steps_per_rollout`` derived it (giving both is an error)."""
    skip = {"log_dir"} | ({"global_batch_size"} if config.num_steps_per_rollout is not None else set())
    values = {k: _plain(v) for k, v in config.to_dict()["values"].items() if k in CORE_BY_NAME and k not in skip}
    values.update({k: absolute_paths(k, v) for k, v in values.items() if k in FILE_OPTIONS + OUTPUT_OPTIONS})
    plugin_values = {name: _plain(v) for opts in config.to_dict()["plugin_values"].values() for name, v in opts.items()}
    out = {"plugin": list(config.plugins), **values, **plugin_values}
    if config.sglang_args:
        out["sglang"] = dict(config.sglang_args)
    header = ("# The complete resolved config of this run (quick-start and plugin-implied values included).\n"
              "# Replay it: slime-core train --config THIS_FILE  (any flag given as well overrides the file)\n")
    return header + yaml.safe_dump(out, sort_keys=False, allow_unicode=True)


# Options naming files or folders. config.yaml holds them absolute, so that a replay works from any folder:
# the inputs when they exist where the run started (else they are left as given: a hub id, ``task:NAME``),
# the outputs (and --load) always.
FILE_OPTIONS = ("prompt_data", "eval_prompt_data", "hf_checkpoint", "eval_config", "sglang_config")
OUTPUT_OPTIONS = ("save", "load", "save_debug_rollout_data", "load_debug_rollout_data")


def absolute_paths(name: str, value: Any) -> Any:
    """``value`` of option ``name`` with its paths made absolute (``path@[start:end]`` keeps its slice; of
    ``--eval-prompt-data NAME PATH ...`` the paths)."""
    if value is None:
        return None
    if name == "eval_prompt_data":
        return [absolute_paths("prompt_data", v) if i % 2 else v for i, v in enumerate(value)]
    if name in OUTPUT_OPTIONS:
        return os.path.abspath(os.path.expanduser(value))
    path, at, rest = str(value).partition("@[")
    found = Path(path).expanduser()
    return str(found.resolve()) + at + rest if found.exists() else value


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def process_started() -> float:
    """When this process started (Unix time), from Linux's process table: the command's start, its imports and
    the default model's conversion included. Elsewhere: when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def record_command(run_dir: Path) -> float:
    """Write ``command.json`` (the command line, its folder, when it started) into the run folder; return the
    start, from which the run's summary counts its time and ``slime-core runs`` dates it."""
    started = process_started()
    (Path(run_dir) / COMMAND).write_text(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "started": started,
        "started_at": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds")}, indent=1) + "\n")
    return started


def link_ray_logs(run_dir: Path, logs: str) -> None:
    """``run_dir/ray-logs`` -> ``logs``, the Ray session's log folder (the actors' full output), replaced when
    a replay reuses the folder."""
    link = Path(run_dir) / RAY_LOGS
    if link.is_symlink():
        link.unlink()
    if not link.exists():
        link.symlink_to(logs, target_is_directory=True)


def write_samples(config: Config, rollout_id: int, samples: list) -> None:
    """Append ``--log-samples`` of this step's samples to ``samples.jsonl`` in the run folder."""
    keep = samples if config.log_samples < 0 else samples[: config.log_samples]
    if not keep or not config.log_dir:
        return
    with (Path(config.log_dir) / "samples.jsonl").open("a", encoding="utf-8") as f:
        for sample in keep:
            status = getattr(sample.status, "value", sample.status)
            f.write(json.dumps({"step": rollout_id, "group": sample.group_index, "index": sample.index,
                                "prompt": sample.prompt, "response": sample.response, "label": sample.label,
                                "reward": sample.reward, "status": status,
                                "response_length": sample.response_length,
                                "weight_versions": sample.weight_version_spans}, default=str) + "\n")


# -- reading runs back -----------------------------------------------------------------------------------------

def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a run killed mid-write leaves a partial last line
    return [r for r in records if "perf/step_time" in r]  # the eval before step 1 is not a step


def quarter_means(values: list[float]) -> tuple[float, float] | None:
    """Mean of the first and of the last quarter (at least one value each)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    n = max(1, len(values) // 4)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def summarize(run_dir: Path, wall_seconds: float | None = None, paths: dict | None = None) -> dict:
    """What a run did, from its metrics: steps, reward per step, first -> last quarter, step time."""
    steps = read_metrics(run_dir)
    rewards = [m.get(REWARD) for m in steps]
    summary: dict[str, Any] = {"run": str(run_dir), "steps": len(steps),
                               "final_reward": next((r for r in reversed(rewards) if r is not None), None)}
    quarters = quarter_means(rewards)
    if quarters:
        summary["reward_first_quarter"], summary["reward_last_quarter"] = quarters
    times = sorted(m["perf/step_time"] for m in steps)
    if times:
        summary["step_time_median"] = times[len(times) // 2]
    if wall_seconds is not None:
        summary["wall_seconds"] = wall_seconds
    if paths:
        summary["paths"] = paths
    return summary


def write_summary(run_dir: Path, summary: dict) -> None:
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def resolve_run(name: str, root: Path = RUNS_ROOT) -> Path:
    """A run folder from a path, a folder name under ``root``, or ``latest``."""
    for candidate in (Path(name), root / name):
        if (candidate / "metrics.jsonl").is_file() or (candidate / "config.yaml").is_file():
            return candidate
    known = ", ".join(p.name for p in list_run_dirs(root)[-5:]) or "none"
    raise FileNotFoundError(f"no run {name!r}: give a run folder (with metrics.jsonl) or a name under {root}/ "
                            f"(newest: {known}); `slime-core runs` lists them")


def list_run_dirs(root: Path = RUNS_ROOT) -> list[Path]:
    """Run folders under ``root``, oldest first (``latest`` is a link to one of them, not listed twice)."""
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
            and ((p / "metrics.jsonl").is_file() or (p / "config.yaml").is_file())]
    return sorted(runs, key=lambda p: (p.stat().st_mtime if not (p / "config.yaml").is_file()
                                       else (p / "config.yaml").stat().st_mtime, p.name))


def run_info(run_dir: Path) -> dict:
    """One row of ``slime-core runs``: start date, plugins, steps (of how many), final reward, state."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    done = run_dir / "summary.json"
    summary = json.loads(done.read_text()) if done.is_file() else summarize(run_dir)
    command = json.loads((run_dir / COMMAND).read_text()) if (run_dir / COMMAND).is_file() else {}
    started = datetime.datetime.fromtimestamp(command.get("started") or (
        (run_dir / "config.yaml").stat().st_mtime if (run_dir / "config.yaml").is_file() else run_dir.stat().st_mtime))
    return {"name": run_dir.name, "path": str(run_dir), "started": f"{started:%Y-%m-%d %H:%M}",
            "plugins": config.get("plugin") or [], "steps": summary["steps"], "num_rollout": config.get("num_rollout"),
            "final_reward": summary.get("final_reward"), "finished": done.is_file(), "summary": summary,
            "config": config}
