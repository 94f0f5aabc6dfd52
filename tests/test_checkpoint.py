"""Checkpoint layout: one directory per training role; a role missing from the checkpoint is an error
that names it (e.g. resuming a GRPO checkpoint with PPO's critic)."""

import pytest
import torch

from slimecore import checkpoint
from slimecore.config import Config, ConfigError


class _Group:
    def __init__(self):
        self.loaded = None

    def load(self, directory):
        self.loaded = directory


def test_every_role_loads_from_its_own_directory_and_a_missing_role_is_named(tmp_path, ray_session):
    directory = checkpoint.iteration_dir(tmp_path, 4)
    (directory / "actor").mkdir(parents=True)
    torch.save({"rollout_id": 4, "data_state": {}, "policy_version": 5}, directory / "rollout_state.pt")
    (tmp_path / checkpoint.MARKER).write_text("4")
    config = Config.make(load=str(tmp_path))
    actor, critic = _Group(), _Group()
    with pytest.raises(FileNotFoundError, match="has no critic/ checkpoint"):
        checkpoint.load(config, {"actor": actor, "critic": critic}, rollout_manager=None)
    (directory / "critic").mkdir()

    class _Manager:
        class load_data_state:  # noqa: N801 (mimics a Ray actor method)
            @staticmethod
            def remote(state):
                import ray

                return ray.put(state)

    assert checkpoint.load(config, {"actor": actor, "critic": critic}, _Manager()) == (5, 5)  # the session's Ray
    assert actor.loaded.endswith("actor") and critic.loaded.endswith("critic")


def _complete(root, rollout_id):
    directory = checkpoint.iteration_dir(root, rollout_id)
    (directory / "actor").mkdir(parents=True)
    (directory / checkpoint.COMPLETE).write_bytes(b"state")


def test_load_on_a_missing_or_empty_directory_starts_fresh_with_a_note(tmp_path, caplog):
    import logging

    from slimecore.preflight import check_load

    (tmp_path / "empty").mkdir()
    for name, why in [("missing", "no such directory"), ("empty", "no checkpoint in it yet")]:
        config = Config.make(load=str(tmp_path / name), save=str(tmp_path / name), num_rollout=3)
        with caplog.at_level(logging.INFO, "slimecore"):
            check_load(config)
        assert f"--load {tmp_path / name}: {why}; starting fresh from --hf-checkpoint, steps 1-3 of --num-rollout 3 " \
               "(as slime does" in caplog.text
        assert checkpoint.load(config, {"actor": _Group()}, rollout_manager=None) == (0, 0)
    killed = tmp_path / "killed"
    (checkpoint.iteration_dir(killed, 0) / "actor").mkdir(parents=True)  # the first save never finished
    assert checkpoint.resume_point(killed).describe(3).startswith(
        f"--load {killed}: only incomplete checkpoints (iter_0000000); starting fresh")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # a model, not a --save directory: not quietly ignored
    with pytest.raises(ConfigError, match=r"hf: not a checkpoint directory \(it holds config.json but no iter_\*/\)"):
        check_load(Config.make(load=str(tmp_path / "hf"), num_rollout=3))


def test_resume_names_the_iteration_and_the_steps_and_refuses_a_finished_run(tmp_path, caplog):
    import logging

    from slimecore.preflight import check_load

    for rollout_id in (1, 4):
        _complete(tmp_path, rollout_id)
    (checkpoint.iteration_dir(tmp_path, 6) / "actor").mkdir(parents=True)  # a save killed half-way
    with caplog.at_level(logging.INFO, "slimecore"):
        check_load(Config.make(load=str(tmp_path), num_rollout=10))
    assert f"resuming from {checkpoint.iteration_dir(tmp_path, 4)}: 5 steps done, running steps 6-10 of " \
           "--num-rollout 10; skipped iter_0000006: incomplete (a save was interrupted), kept as they are" in caplog.text
    # --num-rollout is the run's total: 5 steps are done, so --num-rollout 5 leaves nothing to run
    with pytest.raises(ConfigError, match="iter_0000004 has 5 steps done, which reaches --num-rollout 5: nothing to "
                                          "run.*give --num-rollout 6 or more"):
        check_load(Config.make(load=str(tmp_path), num_rollout=5))
    check_load(Config.make(load=str(tmp_path), num_rollout=5, start_rollout_id=2))  # an explicit start is taken


def test_a_save_moves_an_incomplete_iteration_aside_instead_of_writing_into_it(tmp_path):
    half = checkpoint.iteration_dir(tmp_path, 2)
    (half / "actor").mkdir(parents=True)
    (half / "actor" / "model.safetensors").write_bytes(b"half-written")
    moved = checkpoint.set_aside_incomplete(tmp_path, 2)
    assert moved == tmp_path / checkpoint.INCOMPLETE / "iter_0000002" and not half.exists()
    assert (moved / "actor" / "model.safetensors").read_bytes() == b"half-written"
    (half / "actor").mkdir(parents=True)
    assert checkpoint.set_aside_incomplete(tmp_path, 2).name == "iter_0000002.2"  # the first one is kept
    _complete(tmp_path, 3)
    assert checkpoint.set_aside_incomplete(tmp_path, 3) is None  # a complete one is not incomplete
    assert checkpoint.resume_point(tmp_path).iteration == 3  # incomplete/ is not an iteration
