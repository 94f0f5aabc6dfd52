"""RolloutManager: the Ray actor that owns the engines, the router, the data source and the rollout.

Per step it runs the ``slime_rollout`` hook, turns the samples into training columns (rewards through
``slime_post_process_rewards``), builds the data-parallel schedule and puts one object per DP rank in
the Ray object store. It also pushes new weights to the engines and runs eval.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from pathlib import Path

import ray

from slimecore.config import Config, torch_threads
from slimecore.plugins import load_for_config
from slimecore.raytools import ray_get
from slimecore.types import Sample, Status

log = logging.getLogger("slimecore.rollout")


class RolloutManager:
    def __init__(self, config_dict: dict, placement_group=None, engine_bundles: list[int] | None = None):
        import torch

        torch.set_num_threads(1)
        self.config = config = Config.from_dict(config_dict)
        self.hooks = load_for_config(config)
        self.hooks.startup(config=config, process="rollout")
        from slimecore.models import load_tokenizer

        self.tokenizer = load_tokenizer(config.hf_checkpoint)
        self.data_source = self.hooks.data_source(config=config, tokenizer=self.tokenizer, hooks=self.hooks)
        self.loop = asyncio.new_event_loop()
        self.engines, self.router, self.client = [], None, None
        self._states: dict[int, dict] = {}  # data-source state after each generated step (for checkpoints)
        self._eval_sources: dict[str, object] = {}
        if not (config.debug_train_only or config.load_debug_rollout_data):
            self._start_engines(placement_group, engine_bundles)

    # -- engines ---------------------------------------------------------------------------
    def _start_engines(self, placement_group, engine_bundles) -> None:
        from slimecore.engines.embedded import launch_embedded_engines
        from slimecore.engines.router import Router
        from slimecore.rollout.client import RolloutClient

        c = self.config
        if c.rollout_engine != "embedded":
            raise NotImplementedError("--rollout-engine sglang needs the [sglang] extra and a GPU; not wired yet")
        n = max(1, c.rollout_num_gpus // c.rollout_num_gpus_per_engine)
        self.engines = launch_embedded_engines(n, c.hf_checkpoint, num_cpus=c.num_cpus_per_actor,
                                               placement_group=placement_group, bundle_indices=engine_bundles,
                                               timeout=c.ray_timeout, seed=c.seed, num_threads=torch_threads(c))
        # agent sessions send their id as the router's routing key; the manual policy keeps a key on one engine
        policy = "manual" if self.hooks.implementers("slime_agent") else "round_robin"
        self.router = Router([url for _, url in self.engines], policy=policy)
        self.router.start()
        self.client = RolloutClient(self.router.url, tokenizer=self.tokenizer)

    def engine_urls(self) -> list[str]:
        return [url for _, url in self.engines]

    def router_url(self) -> str | None:
        return self.router.url if self.router else None

    def update_weights(self, weights, version: int) -> float:
        """Load new weights into every engine: ``[ref]`` to a name->tensor dict in the object store (each
        engine fetches it once), or, for disk transport, a safetensors directory. Returns seconds taken."""
        start = time.perf_counter()
        if self.client is not None:
            self.client.policy_version = version  # what the engines serve from now on (fully-async staleness)
        if isinstance(weights, (str, Path)):
            self.loop.run_until_complete(self.client.update_weights_from_disk(str(weights), str(version)))
        else:
            ray_get([engine.load_weights.remote(weights[0], str(version)) for engine, _ in self.engines],
                    f"engines to load weights v{version}", self.config.ray_timeout)
        return time.perf_counter() - start

    # -- one step --------------------------------------------------------------------------
    def num_rollout_per_epoch(self) -> int:
        return len(self.data_source) // self.config.rollout_batch_size

    def generate(self, rollout_id: int, dp_size: int):
        """Run the rollout for ``rollout_id``; return (per-DP-rank object refs or None, metrics)."""
        c = self.config
        start, wall_start = time.perf_counter(), time.time()
        if c.load_debug_rollout_data:
            samples, metrics = self._load_debug(rollout_id), {}
        else:
            out = self.loop.run_until_complete(asyncio.wait_for(
                self.hooks.rollout(config=c, rollout_id=rollout_id, data_source=self.data_source, client=self.client,
                                   hooks=self.hooks, evaluation=False), timeout=c.rollout_timeout))
            samples, metrics = [s for group in out.samples for s in group], dict(out.metrics)
        self._states[rollout_id] = (out.data_state if not c.load_debug_rollout_data and out.data_state is not None
                                    else self.data_source.state_dict())
        for old in [k for k in self._states if k < rollout_id - 2]:
            del self._states[old]
        metrics.update(rollout_metrics(samples, time.perf_counter() - start, c.reward_key))
        metrics.update({"timeline/rollout_start": wall_start, "timeline/rollout_end": time.time()})
        if c.save_debug_rollout_data:
            self._save_debug(rollout_id, samples)
        self.hooks.log_rollout(config=c, rollout_id=rollout_id, samples=samples, metrics=metrics)
        if c.debug_rollout_only:
            return None, metrics
        return self._to_train_refs(samples, dp_size), metrics

    def _to_train_refs(self, samples: list[Sample], dp_size: int) -> list:
        from slimecore.trainers.schedule import split_rollout_data

        data = convert_samples(self.hooks, self.config, samples)
        return [ray.put(part) for part in split_rollout_data(self.config, data, dp_size)]

    # -- eval ------------------------------------------------------------------------------
    def eval(self, rollout_id: int) -> dict[str, float]:
        """Every eval data set (``slimecore.rollout.evaluation``) through ``slime_rollout(evaluation=True)``."""
        from slimecore.data.source import make_eval_source
        from slimecore.rollout.evaluation import eval_datasets, eval_metrics

        metrics: dict[str, float] = {}
        for dataset in eval_datasets(self.config):
            config = dataset.apply(self.config)
            if dataset.name not in self._eval_sources:
                source = make_eval_source(config, self.tokenizer, dataset.path)
                if dataset.rm_type:
                    for record in source.records:
                        record["metadata"] = {**(record.get("metadata") or {}), "rm_type": dataset.rm_type}
                self._eval_sources[dataset.name] = source
            source = self._eval_sources[dataset.name]
            out = self.loop.run_until_complete(self.hooks.rollout(
                config=config, rollout_id=rollout_id, data_source=source, client=self.client, hooks=self.hooks,
                evaluation=True))
            metrics.update(eval_metrics(dataset.name, out.samples, config.reward_key))
        return metrics

    # -- state -----------------------------------------------------------------------------
    def data_state(self, rollout_id: int) -> dict:
        """Data-source state right after ``rollout_id`` was generated (the async loop runs one ahead)."""
        if rollout_id not in self._states:
            return self.data_source.state_dict()
        return self._states[rollout_id]

    def load_data_state(self, state: dict) -> None:
        self.data_source.load_state_dict(state)

    def _save_debug(self, rollout_id: int, samples: list[Sample]) -> None:
        import torch

        path = Path(self.config.save_debug_rollout_data.format(rollout_id=rollout_id))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)

    def _load_debug(self, rollout_id: int) -> list[Sample]:
        import torch

        path = Path(self.config.load_debug_rollout_data.format(rollout_id=rollout_id))
        if not path.is_file():
            raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist for rollout {rollout_id}; "
                                    "dump it first with --save-debug-rollout-data")
        return [Sample.from_dict(d) for d in torch.load(path, weights_only=False)["samples"]]

    def shutdown(self) -> None:
        self.hooks.shutdown(config=self.config, process="rollout")
        if self.client:
            self.loop.run_until_complete(self.client.close())
        if self.router:
            self.router.stop()
        for engine, _ in self.engines:
            ray.kill(engine)


def convert_samples(hooks, config: Config, samples: list[Sample]) -> dict:
    """Samples -> training columns (slime's ``_convert_samples_to_train_data``)."""
    for sample in samples:
        sample.check_aligned()
    raw_rewards, rewards = hooks.post_process_rewards(config=config, samples=samples)
    next_id = max([s.rollout_id for s in samples if s.rollout_id is not None], default=-1) + 1
    rollout_ids = []
    for sample in samples:  # a sample without rollout_id is its own rollout
        if sample.rollout_id is None:
            rollout_ids.append(next_id)
            next_id += 1
        else:
            rollout_ids.append(sample.rollout_id)
    data = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": [[0] * s.response_length if s.remove_sample else
                       list(s.loss_mask if s.loss_mask is not None else [1] * s.response_length) for s in samples],
        "rewards": [float(r) for r in rewards],
        "raw_rewards": [float(r) for r in raw_rewards],
        "rollout_ids": rollout_ids,
        "sample_indices": [s.index for s in samples],
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "weight_versions": [s.weight_versions[-1] if s.weight_versions else None for s in samples],
    }
    if all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [list(s.rollout_log_probs) for s in samples]
    return data


def rollout_metrics(samples: list[Sample], rollout_time: float, reward_key: str | None = None) -> dict[str, float]:
    """slime-named rollout metrics: rewards, lengths, truncation, throughput."""
    if not samples:
        return {"perf/rollout_time": rollout_time}
    lengths = [s.response_length for s in samples]
    rewards = [s.get_reward_value(reward_key) for s in samples if s.reward is not None]
    longest = max(samples, key=lambda s: s.response_length)
    metrics = {
        "rollout/raw_reward": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/response_length": statistics.fmean(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "perf/rollout_time": rollout_time,
        "perf/tokens_per_sec": sum(lengths) / rollout_time if rollout_time > 0 else 0.0,
    }
    if longest.metadata.get("generate_time"):
        metrics["perf/longest_sample_tokens_per_sec"] = longest.response_length / longest.metadata["generate_time"]
    return metrics
