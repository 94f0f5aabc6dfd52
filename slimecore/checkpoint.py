"""Checkpoints: ``{save}/iter_{N:07d}/`` holds the trainer state (model as HF safetensors, optimizer,
RNG), the rollout state (data-source position and buffer, weight version) and, with ``--save-hf``, the model
as an HF checkpoint in ``hf/``; ``--keep-last-n`` deletes older ones. ``rollout_state.pt`` is written after
every role's state and the marker file ``latest_checkpointed_iteration.txt`` last, each atomically (temp
file + rename), so an iteration directory with ``rollout_state.pt`` is complete.

Resuming (``--load DIR``): the newest complete iteration N is restored and the run goes on at step N + 2 (rollout
id N + 1), up to ``--num-rollout``, which counts every step of the run, those before the checkpoint included.
Continuing a finished run is the same with a larger ``--num-rollout``; a checkpoint that already reaches it is
refused before Ray starts. Incomplete iterations are skipped, named, and kept: a later save of the same step
moves one to ``DIR/incomplete/`` before writing. A missing or empty ``DIR`` starts fresh with a note, as slime
does (``--load DIR --save DIR`` on a first run).

Ray is imported only by ``save`` and ``load`` (the driver's, which ask the rollout manager for its state): the
trainers import ``atomic_write_text`` from here and must run without Ray (``benchmarks/train_throughput.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from slimecore.checkpoint_layout import MARKER, iteration_dir

COMPLETE = "rollout_state.pt"  # written after every role's state: its presence marks a complete iteration
INCOMPLETE = "incomplete"  # where a save moves an iteration a killed run left half-written, before rewriting it
log = logging.getLogger("slimecore.checkpoint")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part (temp + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(config, rollout_id: int, policy_version: int, train_groups: dict, rollout_manager) -> Path:
    """``train_groups`` maps a role (``actor``, ``critic``) to its group; each saves under its role's name."""
    set_aside_incomplete(config.save, rollout_id)
    directory = iteration_dir(config.save, rollout_id)
    directory.mkdir(parents=True, exist_ok=True)
    from slimecore.raytools import ray_get

    for role, group in train_groups.items():
        group.save(str(directory / role))
    if config.save_hf and "actor" in train_groups:
        train_groups["actor"].save_hf(save_hf_dir(config, rollout_id))
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


def save_hf_dir(config, rollout_id: int) -> str:
    """Where ``--save-hf`` writes step ``rollout_id``'s HF model: ``PATH.format(rollout_id=...)`` as slime does,
    ``PATH/iter_N`` for a PATH without ``{rollout_id}``, ``iter_N/hf`` of ``--save`` for the bare flag."""
    path = config.save_hf
    if "{rollout_id" not in path:
        path = str(Path(path) / f"iter_{rollout_id:07d}")
    return path.format(rollout_id=rollout_id, save=config.save)


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never one newer than the marker: it may be
    being written); return what was deleted."""
    last = resume_point(root).iteration
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


@dataclass(frozen=True)
class ResumePoint:
    """What ``--load DIR`` holds: the newest complete iteration (``None``: nothing to resume, the run starts
    fresh as slime does on a missing or empty ``--load``) and the incomplete ones a killed save left."""

    directory: Path
    iteration: int | None
    incomplete: tuple[int, ...] = ()

    @property
    def next_rollout(self) -> int:
        """The first rollout id the run trains: the one after the checkpoint's (0 when starting fresh)."""
        return 0 if self.iteration is None else self.iteration + 1

    def describe(self, num_rollout: int | None, start_rollout_id: int | None = None) -> str:
        """One line for the console: the iteration resumed (or why the run starts fresh), the steps it will run,
        and the incomplete iterations skipped."""
        names = ", ".join(iteration_dir(self.directory, n).name for n in self.incomplete)
        start = self.next_rollout if start_rollout_id is None else start_rollout_id
        steps = f"steps {start + 1}-{num_rollout} of --num-rollout {num_rollout}" if num_rollout else \
            f"from step {start + 1}"
        if self.iteration is None:
            why = "no such directory" if not self.directory.exists() else \
                f"only incomplete checkpoints ({names})" if self.incomplete else "no checkpoint in it yet"
            text = (f"--load {self.directory}: {why}; starting fresh from --hf-checkpoint, {steps} (as slime does "
                    "when --load has no checkpoint yet)")
        else:
            text = (f"resuming from {iteration_dir(self.directory, self.iteration)}: {self.iteration + 1} steps done, "
                    f"running {steps}" + (" (--start-rollout-id)" if start_rollout_id is not None else ""))
        if self.incomplete:
            text += (f"; skipped {names}: incomplete (a save was interrupted), kept as they are (a later save of the "
                     f"same step first moves one to {self.directory / INCOMPLETE}/)")
        return text


def resume_point(root: str | Path) -> ResumePoint:
    """Read ``--load``'s directory without changing it. A missing or empty directory (``--load DIR --save DIR``
    on a first run, as slime's scripts do) resumes nothing; a directory that holds files but no ``iter_*`` is
    not a checkpoint directory and is an error, so a mistyped path does not quietly start over."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise FileNotFoundError(f"--load {root}: not a directory; point --load at a directory written by --save")
    found = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()) if root.is_dir() else []
    complete = [n for n in found if (iteration_dir(root, n) / COMPLETE).is_file()]
    others = [p.name for p in root.iterdir() if p.name not in (MARKER, INCOMPLETE)] if root.is_dir() else []
    if not found and others:
        raise FileNotFoundError(f"--load {root}: not a checkpoint directory (it holds {', '.join(sorted(others)[:3])}"
                                f"{' ...' if len(others) > 3 else ''} but no iter_*/); point --load at a directory "
                                "written by --save (an HF model goes to --hf-checkpoint)")
    return ResumePoint(root, complete[-1] if complete else None, tuple(n for n in found if n not in complete))


def latest_complete(root: str | Path) -> int:
    """The newest complete iteration under ``root``; ``FileNotFoundError`` when there is none."""
    point = resume_point(root)
    if point.iteration is None:
        raise FileNotFoundError(f"{root}: no complete checkpoint there (no iter_*/{COMPLETE}"
                                + (f"; {len(point.incomplete)} incomplete iteration(s) from an interrupted save"
                                   if point.incomplete else "") + ")")
    return point.iteration


def set_aside_incomplete(root: str | Path, rollout_id: int) -> Path | None:
    """Move an incomplete ``iter_N`` a killed run left where this save is about to write to ``root/incomplete/``
    (under a free name), so that it is kept and never mixed with the new files; return where it went."""
    directory = iteration_dir(root, rollout_id)
    if not directory.is_dir() or (directory / COMPLETE).is_file():
        return None
    aside = Path(root) / INCOMPLETE
    aside.mkdir(exist_ok=True)
    target = aside / directory.name
    for n in range(2, 1000):
        if not target.exists():
            break
        target = aside / f"{directory.name}.{n}"
    os.replace(directory, target)
    log.warning("%s was incomplete (a save was interrupted): moved to %s before saving step %d again", directory,
                target, rollout_id + 1)
    return target


def load(config, train_groups: dict, rollout_manager) -> tuple[int, int]:
    """Restore the last checkpoint under ``--load``; return (first rollout id to run, policy version)."""
    from slimecore.raytools import ray_get

    point = resume_point(config.load)
    if point.iteration is None:  # a missing or empty --load: a fresh start (said by the preflight)
        return 0, 0
    last, directory = point.iteration, iteration_dir(config.load, point.iteration)
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


__all__ = ["save", "load", "latest_complete", "resume_point", "ResumePoint", "set_aside_incomplete", "iteration_dir", "atomic_write_text", "prune", "save_final"]
