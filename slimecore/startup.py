"""One start-up path for a run, whoever starts it: ``slime-core train`` and ``slimecore.loop.run`` called from
Python make the same checks, in the same order, with the same messages, and pair the driver's lifecycle hooks.

``prepare(config, hooks)``, before Ray starts (each failure is one ``ConfigError`` / ``PluginError`` line naming the
flag, file, plugin or hook):

1. ``slime_validate_config``: each plugin's checks of its options;
2. the contract (``Hooks.check``): no two plugins answering a one-answer hook, every required hook implemented
   (but those a debug mode never calls);
3. the reward sources: ``--reward-weights`` gives one weight per reward (``slimecore.rollout.rewards``);
4. ``finalize``: the settings derived once (the model path, ``--num-rollout``, ``--train-iters``);
5. the training backend's own checks (``slimecore.trainers.backend.check_startup``), and Megatron arguments
   given as flags against the checkpoint's ``config.json``;
6. the run folder (``--log-dir``, or a new one under ``runs/``), the roles (``slime_train_roles``) and the
   preflight (``slimecore.preflight.check_before_ray``: data files, checkpoints, ``--save``, hook signatures,
   placement), which checks the tokenizer.

It returns a :class:`Prepared` (the run folder, the roles in training order, the checked tokenizer); a second
call on the same config returns the first one's, so a caller that prepared (the CLI, to fail before it imports
Ray) hands the same config to ``loop.run``.

``driver(config, hooks)`` is the driver process's life as the plugins see it: ``slime_startup(process="driver")``
on entry and ``slime_shutdown(process="driver")`` on the way out, however the run ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from slimecore.config import Config
from slimecore.finalize import finalize
from slimecore.plugins import Hooks

PREPARED, VALIDATED = "prepared", "validated"  # config.__dict__ keys: this config's Prepared, and that it was validated


@dataclass
class Prepared:
    """What ``prepare`` found: the run folder, the roles in training order, the tokenizer the preflight checked
    (shipped to the rollout manager instead of being loaded again)."""

    run_dir: Path
    roles: list
    tokenizer: Any


def prepare(config: Config, hooks: Hooks) -> Prepared:
    """Every check that can fail before Ray, in the order of the module docstring (see there)."""
    prepared = config.__dict__.get(PREPARED)
    if prepared is not None:
        return prepared
    validate(config, hooks)
    hooks.check(skip_required=not_needed(config))
    from slimecore.rollout.rewards import check_reward_sources

    check_reward_sources(hooks, config)
    finalize(config, hooks)
    from slimecore.trainers.backend import check_startup

    check_startup(config, hooks)
    from slimecore.preflight import check_before_ray
    from slimecore.runs import create_run_dir
    from slimecore.trainers.roles import declared_roles

    run_dir = create_run_dir(config)
    roles = declared_roles(config, hooks)
    prepared = Prepared(run_dir, roles, check_before_ray(config, hooks, roles))
    config.__dict__[PREPARED] = prepared
    return prepared


def validate(config: Config, hooks: Hooks) -> None:
    """Step 1, ``slime_validate_config`` (once per config: a caller that parses flags may run it at once)."""
    hooks.bind(config)
    if not config.__dict__.get(VALIDATED):
        hooks.slime_validate_config(config=config)
        config.__dict__[VALIDATED] = True


def not_needed(config: Config) -> list[str]:
    """Required hooks a debug mode never calls."""
    if config.debug_rollout_only:
        return ["slime_compute_advantages", "slime_loss"]
    return []


@contextlib.contextmanager
def driver(config: Config, hooks: Hooks) -> Iterator[None]:
    """``slime_startup`` / ``slime_shutdown`` of the driver process, paired: the second runs whatever ends the run."""
    hooks.slime_startup(config=config, process="driver")
    try:
        yield
    finally:
        hooks.slime_shutdown(config=config, process="driver")
