"""The driver loop: generate -> train the roles -> sync weights -> save / eval.

Each mode is one function that reads top to bottom, as slime keeps ``train.py`` and ``train_async.py`` apart:
``sync_loop`` (every step generates with the newest weights), ``async_loop`` (``--train-async`` and
``--fully-async``: generation of step N+1 overlaps training on step N) and ``rollout_only_loop``
(``--debug-rollout-only``). With no engines (``--no-engines``, slime's ``--debug-train-only``; ``--load-debug-rollout-data``) the sync and
async loops train with nothing to sync. Start-up, shutdown and SIGTERM are :class:`Job`'s, once for every mode.

There are no algorithm or role names here: which models train, in which order and on what, is
``slimecore.trainers.roles``' (declared) and ``RoleGroups``' (trained). Each stage is a hook call or a Ray call with a timeout whose error says what
was being waited for.
"""

from __future__ import annotations

import logging
import importlib
import signal
import threading
import time
from typing import Callable

import ray
import ray.util

from slimecore import checkpoint, weight_updates
from slimecore.config import Config
from slimecore.hf_checkpoint import ship_tokenizer
from slimecore.plugins import Hooks
from slimecore.preflight import release_log_dir
from slimecore.raytools import create_placement, init_ray, ray_get
from slimecore.rollout.manager import RolloutManager
from slimecore.startup import driver, prepare
from slimecore.tracking import Tracker
from slimecore.trainers.ray_actors import RoleGroups
from slimecore.trainers.roles import TrainRole
from slimecore.weight_updates import REPUSH, WeightRepush

log = logging.getLogger("slimecore.loop")
StepCallback = Callable[[int, int, dict], None]
StageCallback = Callable[[str, int], None]  # (stage, rollout_id): start generate train sync save eval export


def run(config: Config, hooks: Hooks, on_step: StepCallback | None = None,
        on_stage: StageCallback | None = None) -> list[dict]:
    """Run the whole job; returns the metrics of every step (also written to the run folder, ``--log-dir``).
    ``slimecore.startup.prepare`` checks and completes the config first, as for ``slime-core train`` (which
    prepares it before importing this module, so a bad input fails within seconds; its result is reused)."""
    prepared = prepare(config, hooks)
    with driver(config, hooks):  # the driver's slime_startup, and its slime_shutdown however the run ends
        job = Job(config, hooks, prepared.roles, on_step, on_stage, prepared.tokenizer)
        completed = interrupted = False
        try:
            job.sync_weights()  # engines start from the checkpoint on disk; make them serve the trainer's weights
            if job.start == 0 and not config.skip_eval_before_train and (config.eval_prompt_data or config.eval_config):
                job.tracker.log(job.evaluate(0), 0)
            loop = rollout_only_loop if config.debug_rollout_only else async_loop if config.train_async else sync_loop
            loop(job)
            job.export()
            completed = True
        except KeyboardInterrupt:  # SIGINT, or SIGTERM through _interrupt
            interrupted = True
            if job.repush is not None and job.repush.error is not None:  # it interrupted the main thread
                raise job.repush.error from None
            raise
        finally:
            job.close(completed, interrupted)
    return job.history


def sync_loop(job: Job) -> None:
    """Each step generates with the weights the last step trained, then trains and pushes them."""
    for rollout_id in range(job.start, job.num_rollout):
        step_start = time.perf_counter()
        refs, metrics = job.generate(rollout_id, job.request(rollout_id))
        job.train(rollout_id, refs, metrics, push=True)
        job.end_step(rollout_id, metrics, step_start)


def async_loop(job: Job) -> None:
    """Generation of step N+1 runs while step N trains, with weights one step old; the weights go to the
    engines every ``--update-weights-interval`` steps, after the manager finishes the generation in flight.
    ``--fully-async`` differs only inside the rollout manager, whose worker keeps groups in flight across steps."""
    pending = job.request(job.start)
    for rollout_id in range(job.start, job.num_rollout):
        step_start = time.perf_counter()
        refs, metrics = job.generate(rollout_id, pending)
        pending = job.request(rollout_id + 1)
        job.train(rollout_id, refs, metrics, push=(rollout_id + 1) % job.config.update_weights_interval == 0)
        job.end_step(rollout_id, metrics, step_start)


def rollout_only_loop(job: Job) -> None:
    """``--debug-rollout-only``: generate and score each step (``--save-debug-rollout-data`` keeps them)."""
    for rollout_id in range(job.start, job.num_rollout):
        step_start = time.perf_counter()
        _, metrics = job.generate(rollout_id, job.request(rollout_id))
        job.end_step(rollout_id, metrics, step_start)


class Job:
    """One run's Ray processes and progress, shared by every mode: it starts Ray, the rollout manager and the
    training roles (restoring ``--load``), runs the stages of a step, and ends everything in ``close``."""

    def __init__(self, config: Config, hooks: Hooks, roles: list[TrainRole], on_step: StepCallback | None,
                 on_stage: StageCallback | None, tokenizer=None):
        self.config, self.hooks, self.on_step = config, hooks, on_step
        self.stage = on_stage or (lambda name, rollout_id: None)
        self.wait, self.history = config.ray_timeout, []
        init_ray(config)
        # after ray.init, whose driver installs its own SIGTERM handler (it aborts the process, leaving actors behind)
        self.previous_sigterm = signal.signal(signal.SIGTERM, _interrupt) or signal.SIG_DFL
        if config.use_tensorboard:  # 2 s of imports (torch with it): on a thread, while the actors start
            _import_on_a_thread("torch.utils.tensorboard")
        self.pg, train_bundles, engine_bundles = create_placement(config, [role.name for role in roles])
        shipped = None if tokenizer is None else ship_tokenizer(tokenizer)
        self.rollout = ray.remote(num_cpus=0, concurrency_groups={REPUSH: 1})(RolloutManager).remote(
            config.to_dict(), self.pg, engine_bundles, tokenizer=shipped)
        # the train ranks load while the manager starts its engines and router: neither waits for the other
        self.trainers = None if config.debug_rollout_only else RoleGroups(config, roles, self.pg, train_bundles)
        try:
            ray_get(self.rollout.__ray_ready__.remote(), "the rollout manager (engines, router, data source) to start",
                    self.wait)
        except BaseException:  # the run ends here: the train ranks end with Ray, their weight files are removed
            for group in (self.trainers.groups if self.trainers else {}).values():
                group.unlink_shared_memory()
            raise
        self.tracker = Tracker(config, [f"{p.name} ({p.origin})" for p in hooks.plugins])
        self.groups = self.trainers.groups if self.trainers else {}
        self.dp_size = self.trainers.actor.dp_size if self.trainers else 1
        self.start, self.version = checkpoint.load(config, self.groups, self.rollout) if config.load else (0, 0)
        if config.start_rollout_id is not None:
            self.start = config.start_rollout_id
        self.num_rollout = config.num_rollout
        self.engines_live = config.starts_engines
        self.final_model = None
        self.repush = None  # the trainers' push again to engines restarted while none served their weights
        if self.trainers and self.engines_live and config.use_fault_tolerance:
            self.repush = WeightRepush(config, self.trainers.actor, self.rollout).start()

    def request(self, rollout_id: int):
        """Start generating ``rollout_id`` (None past the last step); ``ray_get`` it for (refs, metrics)."""
        return self.rollout.generate.remote(rollout_id, self.dp_size) if rollout_id < self.num_rollout else None

    def generate(self, rollout_id: int, pending) -> tuple[list | None, dict]:
        """Wait for the rollout ``pending`` (``request(rollout_id)``): per-rank data refs and its metrics."""
        self.stage("generate", rollout_id)
        wait_start = time.perf_counter()
        refs, metrics = ray_get(pending, f"rollout {rollout_id}", self.wait)
        metrics["perf/rollout_wait_time"] = time.perf_counter() - wait_start
        return refs, metrics

    def train(self, rollout_id: int, refs: list, metrics: dict, push: bool) -> None:
        """Every role trains on the rollout (``slimecore.trainers.roles``); the engines get the new weights when
        the actor's changed and ``push``. Colocated, the devices change hands around it."""
        self.stage("train", rollout_id)
        if self.engines_live:
            weight_updates.before_train(self.config, self.groups, self.rollout)
        metrics["timeline/train_start"] = time.time()
        role_metrics, actor_updated = self.trainers.train(rollout_id, refs, self.version)
        metrics.update(role_metrics)
        metrics["timeline/train_end"] = time.time()
        self.version += int(actor_updated)
        push = push and actor_updated
        if self.engines_live:
            if push:
                self.stage("sync", rollout_id)
            metrics["perf/update_weights_time"] = weight_updates.after_train(self.config, self.groups, self.rollout,
                                                                             self.version, push)
        elif push:
            metrics["perf/update_weights_time"] = 0.0  # no engines (SFT): nothing to sync

    def end_step(self, rollout_id: int, metrics: dict, step_start: float) -> None:
        """Save and evaluate at their intervals (and after the last step), then log the step."""
        config, last = self.config, rollout_id + 1 == self.num_rollout
        if config.save and (last or (config.save_interval and (rollout_id + 1) % config.save_interval == 0)):
            self.stage("save", rollout_id)
            save_start = time.perf_counter()
            checkpoint.save(config, rollout_id, self.version, self.groups, self.rollout)
            metrics["perf/save_time"] = time.perf_counter() - save_start
        if config.eval_interval and ((rollout_id + 1) % config.eval_interval == 0 or last):
            self.stage("eval", rollout_id)
            metrics.update(self.evaluate(rollout_id + 1))
        metrics["perf/step_time"] = time.perf_counter() - step_start
        self.hooks.slime_step_end(config=config, rollout_id=rollout_id, metrics=metrics)
        self.tracker.log(metrics, rollout_id)
        self.history.append(metrics)
        if self.on_step:
            self.on_step(rollout_id, self.num_rollout, metrics)

    def sync_weights(self) -> float:
        """Push the actor's weights to every engine; the engines then serve ``version``."""
        if self.trainers is None or not self.engines_live:
            return 0.0
        return weight_updates.sync_weights(self.config, self.trainers.actor, self.rollout, self.version)

    def evaluate(self, rollout_id: int) -> dict:
        if not (self.config.eval_prompt_data or self.config.eval_config) or not self.engines_live:
            return {}
        return ray_get(self.rollout.eval.remote(rollout_id), f"eval at step {rollout_id}", self.wait)

    def export(self) -> None:
        """The trained model, as an HF checkpoint in the run folder."""
        if self.trainers is not None:
            self.stage("export", self.num_rollout)
            self.final_model = checkpoint.save_final(self.config, self.trainers.actor)

    def close(self, completed: bool, interrupted: bool) -> None:
        signal.signal(signal.SIGTERM, self.previous_sigterm)
        if self.repush is not None:
            self.repush.stop()
        if interrupted:  # abandon the step in flight: the actors may be busy with it, so they are killed, not asked
            for actor in [self.rollout, *(a for group in self.groups.values() for a in group.actors)]:
                ray.kill(actor)  # engines are owned by the manager and die with it, the router with its process
            for group in self.groups.values():
                group.unlink_shared_memory()
        else:
            for group in self.groups.values():
                group.shutdown()
            ray_get(self.rollout.shutdown.remote(), "the rollout manager to shut down", self.wait)
        ray.util.remove_placement_group(self.pg)
        self.tracker.close(completed, self.final_model)
        release_log_dir(self.config.log_dir)


def _import_on_a_thread(module: str) -> None:
    """Import ``module`` on a thread of its own; an error is left for the import that needs the module."""
    def run():
        try:
            importlib.import_module(module)
        except Exception:
            pass

    threading.Thread(target=run, name=f"import-{module}", daemon=True).start()


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C (SIGINT), so the run ends the same way. ``str()`` is the signal's name."""


_RECEIVED: list[str] = []  # the signals _interrupt turned into RunInterrupted


def _interrupt(signum, frame):
    _RECEIVED.append(signal.Signals(signum).name)
    raise RunInterrupted(_RECEIVED[-1])


def interrupted_by(exc: KeyboardInterrupt) -> str:
    """The signal that interrupted the run. Ray's ``get`` turns a KeyboardInterrupt raised by a signal handler
    while it waits into a bare one, without the name, so the last signal ``_interrupt`` received counts; else
    SIGINT (Ctrl-C, which Python raises itself)."""
    return str(exc) or (_RECEIVED[-1] if _RECEIVED else "SIGINT")
