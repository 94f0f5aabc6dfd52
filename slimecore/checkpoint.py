"""Checkpoints: ``{save}/iter_{N:07d}/`` holds the trainer state (model as HF safetensors, optimizer,
RNG), the rollout state (data-source position and buffer, weight version) and, with ``--save-hf``, the model
as an HF checkpoint in ``hf/``; ``--keep-last-n`` deletes older ones. The marker file
``latest_checkpointed_iteration.txt`` is written last, atomically, so a run killed mid-save resumes
from the previous complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from slimecore.raytools import ray_get

MARKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def latest_iteration(root: str | Path) -> int | None:
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)


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
    tmp = directory / "rollout_state.pt.tmp"
    torch.save({"rollout_id": rollout_id, "data_state": data_state, "policy_version": policy_version}, tmp)
    os.replace(tmp, directory / "rollout_state.pt")
    marker_tmp = Path(config.save) / (MARKER + ".tmp")
    marker_tmp.write_text(str(rollout_id))
    os.replace(marker_tmp, Path(config.save) / MARKER)
    if config.keep_last_n:
        prune(config.save, config.keep_last_n)
    return directory


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never one newer than the marker: it may be
    being written); return what was deleted."""
    last = latest_iteration(root)
    done = sorted((int(p.name[len("iter_"):]), p) for p in Path(root).glob("iter_*")
                  if p.name[len("iter_"):].isdigit() and last is not None and int(p.name[len("iter_"):]) <= last)
    doomed = [p for _, p in done[:-keep]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def save_final(config, actor) -> Path:
    """The trained model as an HF checkpoint in the run folder's ``final/`` (``slimecore.export``)."""
    directory = Path(config.log_dir) / "final"
    actor.save_hf(str(directory))
    return directory


def load(config, train_groups: dict, rollout_manager) -> tuple[int, int]:
    """Restore the last checkpoint under ``--load``; return (first rollout id to run, policy version)."""
    last = latest_iteration(config.load)
    if last is None:
        raise FileNotFoundError(f"--load {config.load}: no {MARKER} there; point --load at a directory written by "
                                "--save, or drop --load to start fresh")
    directory = iteration_dir(config.load, last)
    state = torch.load(directory / "rollout_state.pt", weights_only=False)
    for role, group in train_groups.items():
        if not (directory / role).is_dir():
            raise FileNotFoundError(f"--load {config.load}: {directory} has no {role}/ checkpoint; it was saved by a "
                                    f"run without the {role} role (check the --plugin list)")
        group.load(str(directory / role))
    ray_get(rollout_manager.load_data_state.remote(state["data_state"]), "the data source to restore its state",
            config.ray_timeout)
    return last + 1, state["policy_version"]


__all__ = ["save", "load", "latest_iteration", "iteration_dir", "prune", "save_final"]
