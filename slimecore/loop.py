"""The driver loop: generate -> train -> sync weights -> save / eval, synchronous or one step off-policy.

Read top to bottom; there are no algorithm names here. Each stage is a hook call or a Ray call with a
timeout whose error says what was being waited for.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

import ray
import ray.util

from slimecore import checkpoint, weight_updates
from slimecore.config import Config, ConfigError
from slimecore.plugins import Hooks
from slimecore.preflight import check_before_ray, release_log_dir
from slimecore.raytools import create_placement, init_ray, ray_get
from slimecore.rollout.manager import RolloutManager
from slimecore.tracking import Tracker
from slimecore.trainers.actor import TrainGroup

log = logging.getLogger("slimecore.loop")
StepCallback = Callable[[int, int, dict], None]
StageCallback = Callable[[str, int], None]  # (stage, rollout_id): start generate train sync save eval export


def run(config: Config, hooks: Hooks, on_step: StepCallback | None = None,
        on_stage: StageCallback | None = None) -> list[dict]:
    """Run the whole job; returns the metrics of every step (also written to the run folder, ``--log-dir``)."""
    stage = on_stage or (lambda name, rollout_id: None)
    extra_roles = sorted({role for answer in hooks.train_roles(config=config) for role in answer or ()} - {"actor"})
    if set(extra_roles) - {"critic"}:
        raise ConfigError(f"slime_train_roles returned unknown role(s) {sorted(set(extra_roles) - {'critic'})}; the "
                          "core places 'actor' and 'critic' (a value model)")
    check_before_ray(config, hooks)
    init_ray(config)
    # after ray.init, whose driver installs its own SIGTERM handler (it aborts the process, leaving actors behind)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt) or signal.SIG_DFL
    tracker = Tracker(config, [f"{p.name} ({p.origin})" for p in hooks.plugins])
    wait = config.ray_timeout
    pg, train_bundles, engine_bundles = create_placement(config, ["actor", *extra_roles])
    rollout = ray.remote(RolloutManager).options(num_cpus=0).remote(config.to_dict(), pg, engine_bundles)
    # the train ranks load while the manager starts its engines and router: neither waits for the other
    train = None if config.debug_rollout_only else TrainGroup(config, pg, train_bundles["actor"])
    critic = TrainGroup(config, pg, train_bundles["critic"], role="critic") if train and extra_roles else None
    ray_get(rollout.__ray_ready__.remote(), "the rollout manager (engines, router, data source) to start", wait)
    groups = {"actor": train, "critic": critic} if critic else {"actor": train} if train else {}
    dp_size = train.dp_size if train else 1

    start, version = 0, 0
    if config.load:
        start, version = checkpoint.load(config, groups, rollout)
    if config.start_rollout_id is not None:
        start = config.start_rollout_id
    num_rollout = config.num_rollout
    if num_rollout is None:
        per_epoch = ray_get(rollout.num_rollout_per_epoch.remote(), "the data source size", wait)
        num_rollout = per_epoch * (config.num_epoch or 1)
    engines_live = not (config.debug_train_only or config.load_debug_rollout_data)

    def sync_weights() -> float:
        """Push the trainer's weights to every engine; the engines then serve ``version``."""
        if train is None or not engines_live:
            return 0.0
        return weight_updates.sync_weights(config, train, rollout, version)

    def evaluate(rollout_id: int) -> dict:
        if not (config.eval_prompt_data or config.eval_config) or not engines_live:
            return {}
        return ray_get(rollout.eval.remote(rollout_id), f"eval at step {rollout_id}", wait)

    history: list[dict] = []
    interrupted = False
    completed, final_model = False, None
    try:
        sync_weights()  # engines start from the checkpoint on disk; make them serve the trainer's weights
        if start == 0 and not config.skip_eval_before_train and (config.eval_prompt_data or config.eval_config):
            tracker.log(evaluate(0), 0)
        pending = rollout.generate.remote(start, dp_size) if config.train_async and start < num_rollout else None
        for rollout_id in range(start, num_rollout):
            step_start = time.perf_counter()
            stage("generate", rollout_id)
            if config.train_async:
                refs, metrics = ray_get(pending, f"rollout {rollout_id}", wait)
                # generation of the next step overlaps this step's training; it uses weights one step old
                pending = rollout.generate.remote(rollout_id + 1, dp_size) if rollout_id + 1 < num_rollout else None
            else:
                refs, metrics = ray_get(rollout.generate.remote(rollout_id, dp_size), f"rollout {rollout_id}", wait)
            metrics["perf/rollout_wait_time"] = time.perf_counter() - step_start
            if train is not None:
                stage("train", rollout_id)
                if engines_live:
                    weight_updates.before_train(config, groups, rollout)
                train_start, metrics["timeline/train_start"] = time.perf_counter(), time.time()
                # a critic first scores the samples; the actor trains on advantages from those values and
                # hands its returns to the critic, which trains last (Ray passes both rank to rank)
                values = critic.values_refs(refs) if critic else None
                actor_updates = rollout_id >= config.num_critic_only_steps
                metrics.update(train.train(rollout_id, refs, version, extra=values, update=actor_updates))
                metrics["perf/actor_train_time"] = time.perf_counter() - train_start
                if critic:
                    critic_start = time.perf_counter()
                    metrics.update(critic.train(rollout_id, refs, version, extra=train.outputs_refs()))
                    metrics["perf/critic_train_time"] = time.perf_counter() - critic_start
                metrics["timeline/train_end"] = time.time()
                version += int(actor_updates)
                # async: the manager finishes the in-flight generation before it pauses the engines
                interval = (rollout_id + 1) % config.update_weights_interval == 0
                push = actor_updates and (not config.train_async or interval)
                if engines_live:
                    if push:
                        stage("sync", rollout_id)
                    metrics["perf/update_weights_time"] = weight_updates.after_train(config, groups, rollout, version,
                                                                                     push)
                elif push:
                    metrics["perf/update_weights_time"] = 0.0  # no engines (SFT): nothing to sync
            last = rollout_id + 1 == num_rollout
            if config.save and (last or (config.save_interval and (rollout_id + 1) % config.save_interval == 0)):
                stage("save", rollout_id)
                save_start = time.perf_counter()
                checkpoint.save(config, rollout_id, version, groups, rollout)
                metrics["perf/save_time"] = time.perf_counter() - save_start
            if config.eval_interval and ((rollout_id + 1) % config.eval_interval == 0 or last):
                stage("eval", rollout_id)
                metrics.update(evaluate(rollout_id + 1))
            metrics["perf/step_time"] = time.perf_counter() - step_start
            hooks.step_end(config=config, rollout_id=rollout_id, metrics=metrics)
            tracker.log(metrics, rollout_id)
            history.append(metrics)
            if on_step:
                on_step(rollout_id, num_rollout, metrics)
        if train is not None:  # the trained model, as an HF checkpoint in the run folder
            stage("export", num_rollout)
            final_model = checkpoint.save_final(config, train)
        completed = True
    except KeyboardInterrupt:  # SIGINT, or SIGTERM through _interrupt
        interrupted = True
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if interrupted:  # abandon the step in flight: the actors may be busy with it, so they are killed, not asked
            for actor in [rollout, *(a for group in groups.values() for a in group.actors)]:
                ray.kill(actor)  # engines are owned by the manager and die with it, the router with its process
        else:
            for group in groups.values():
                group.shutdown()
            ray_get(rollout.shutdown.remote(), "the rollout manager to shut down", wait)
        ray.util.remove_placement_group(pg)
        hooks.shutdown(config=config, process="driver")
        tracker.close(completed, final_model)
        release_log_dir(config.log_dir)
    return history


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C (SIGINT), so the run ends the same way."""


def _interrupt(signum, frame):
    raise RunInterrupted(signal.Signals(signum).name)
