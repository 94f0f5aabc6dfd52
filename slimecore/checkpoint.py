"""Checkpoints: ``{save}/iter_{N:07d}/`` holds the trainer state (model as HF safetensors, optimizer,
RNG), the rollout state (data-source position and buffer, weight version) and, with ``--save-hf``, the model
as an HF checkpoint in ``hf/``; ``--keep-last-n`` deletes older ones. ``rollout_state.pt`` is written after
every role's state and the marker file ``latest_checkpointed_iteration.txt`` last, each atomically (temp
file + rename), so an iteration directory with ``rollout_state.pt`` is complete. ``--load`` takes the newest
complete one and says so when it skips one a killed run left half-written.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from slimecore.raytools import ray_get

MARKER = "latest_checkpointed_iteration.txt"
COMPLETE = "rollout_state.pt"  # written after every role's state: its presence marks a complete iteration
log = logging.getLogger("slimecore.checkpoint")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part (temp + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def iteration_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def save(config, rollout_id: int, policy_version: int, train_groups: dict, rollout_manager) -> Path:
    """``train_groups`` maps a role (``actor``, ``critic``) to its group; each saves under its role's name."""
    directory = iteration_dir(config.save, rollout_id)
    directory.mkdir(parents=True, exist_ok=True)
    for role, group in train_groups.items():
        group.save(str(directory / role))
    if config.save_hf and "actor" in train_groups:
        train_groups["actor"].save_hf(str(directory / "hf"))
    data_state = ray_get(rollout_manager.data_state.remote(rollout_id), "the rollout manager's data state",
                         config.ray_timeout)
    import torch  # here, not at the top: the driver imports this module before Ray and needs no torch until then

    tmp = directory / f"{COMPLETE}.tmp"
    torch.save({"rollout_id": rollout_id, "data_state": data_state, "policy_version": policy_version}, tmp)
    os.replace(tmp, directory / COMPLETE)
    atomic_write_text(Path(config.save) / MARKER, str(rollout_id))
    if config.keep_last_n:
        prune(config.save, config.keep_last_n)
    return directory


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never one newer than the marker: it may be
    being written); return what was deleted."""
    last = latest_complete(root)
    done = sorted((int(p.name[len("iter_"):]), p) for p in Path(root).glob("iter_*")
                  if p.name[len("iter_"):].isdigit() and int(p.name[len("iter_"):]) <= last)
    doomed = [p for _, p in done[:-keep]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def save_final(config, actor) -> Path:
    """The trained model as an HF checkpoint in the run folder's ``final/`` (``slimecore.export``)."""
    directory = Path(config.log_dir) / "final"
    actor.save_hf(str(directory))
    return directory


def latest_complete(root: str | Path) -> int:
    """The newest complete iteration under ``root``; one left half-written by a killed save is skipped, with a
    warning naming it."""
    root = Path(root)
    found = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())
    complete = [n for n in found if (iteration_dir(root, n) / COMPLETE).is_file()]
    if not complete:
        raise FileNotFoundError(f"--load {root}: no complete checkpoint there (no iter_*/{COMPLETE}"
                                + (f"; {len(found)} incomplete iteration(s) from an interrupted save" if found else "")
                                + "); point --load at a directory written by --save, or drop --load to start fresh")
    skipped = [n for n in found if n > complete[-1]]
    if skipped:
        log.warning("--load %s: %s is incomplete (a save was interrupted); resuming from %s, the last complete "
                    "checkpoint", root, ", ".join(iteration_dir(root, n).name for n in skipped),
                    iteration_dir(root, complete[-1]).name)
    return complete[-1]


def load(config, train_groups: dict, rollout_manager) -> tuple[int, int]:
    """Restore the last checkpoint under ``--load``; return (first rollout id to run, policy version)."""
    last = latest_complete(config.load)
    directory = iteration_dir(config.load, last)
    import torch

    state = torch.load(directory / COMPLETE, weights_only=False)
    for role, group in train_groups.items():
        if not (directory / role).is_dir():
            raise FileNotFoundError(f"--load {config.load}: {directory} has no {role}/ checkpoint; it was saved by a "
                                    f"run without the {role} role (check the --plugin list)")
        group.load(str(directory / role))
    ray_get(rollout_manager.load_data_state.remote(state["data_state"]), "the data source to restore its state",
            config.ray_timeout)
    return last + 1, state["policy_version"]


__all__ = ["save", "load", "latest_complete", "iteration_dir", "atomic_write_text", "prune", "save_final"]
