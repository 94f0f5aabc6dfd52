"""What checkpoint folders look like on disk, with nothing but the standard library, so that the config's checks
(before Ray, before torch) can read them: slime-core's own iteration folders (``{save}/iter_{N:07d}/`` and the marker
file ``latest_checkpointed_iteration.txt``, written by ``slimecore.checkpoint``) and Megatron-LM's checkpoint roots,
which use the same marker and folder names (what slime's tools/convert_hf_to_torch_dist.py writes)."""

from __future__ import annotations

from pathlib import Path

MARKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def megatron_lm_checkpoint(path: str | Path, step: int | None = None) -> Path | None:
    """The ``dist_checkpointing`` folder of a Megatron-LM checkpoint at ``path`` (what Megatron-LM's save_checkpoint and
    slime's tools/convert_hf_to_torch_dist.py write): a root whose ``latest_checkpointed_iteration.txt`` holds an
    iteration N (``iter_{N:07d}/``) or ``release`` (``release/``), or such a folder given directly (it holds
    ``metadata.json``). ``step`` (slime's --ref-ckpt-step, --opd-teacher-ckpt-step) picks ``iter_{step:07d}/``
    instead of the tracker. None when ``path`` is neither; ValueError (the path and what to do, no flag) when the
    tracker is unreadable or names, or ``step`` asks for, a folder that is missing or no torch_dist checkpoint."""
    path = Path(path)
    if step is not None:
        folder = iteration_dir(path, step)
        if not (folder / "metadata.json").is_file():
            raise ValueError(f"the step asked for is {folder.name}, which " + (
                "holds no torch_dist checkpoint (no metadata.json)" if folder.is_dir() else "does not exist")
                + "; a step picks an iteration folder of a Megatron-LM checkpoint root")
        return folder
    if (path / "metadata.json").is_file() and (path.name == "release" or path.name.startswith("iter_")):
        return path
    tracker = path / MARKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        folder = path / "release"
    else:
        try:
            folder = iteration_dir(path, int(text))
        except ValueError:
            raise ValueError(f"a Megatron-LM checkpoint root whose {MARKER} holds {text[:40]!r}, neither an "
                             "iteration number nor 'release'; write the iteration to load there, or give its "
                             "iter_NNNNNNN folder") from None
    if not (folder / "metadata.json").is_file():
        if (folder / "actor").is_dir():  # slime-core's own save: iter_N/ holds one folder per role
            raise ValueError(f"a slime-core checkpoint root ({folder.name} holds a folder per role); give the "
                             f"role's folder, {folder / 'actor'}")
        raise ValueError(f"a Megatron-LM checkpoint root whose {MARKER} names {folder.name}, which " + (
            "holds no torch_dist checkpoint (no metadata.json)" if folder.is_dir() else "does not exist")
            + "; point the tracker at a saved iteration, or give that iteration's folder")
    return folder
