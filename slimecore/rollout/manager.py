"""RolloutManager: the Ray actor that owns the engines, the router, the data source and the rollout.

Per step it runs the ``slime_rollout`` hook, turns the samples into training columns (rewards through
``slime_post_process_rewards``), builds the data-parallel schedule and puts one object per DP rank in
the Ray object store. It also pushes new weights to the engines and runs eval.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import ray

from slimecore import aio
from slimecore.config import Config
from slimecore.errors import check_reward_failures
from slimecore.plugins import load_for_config
from slimecore.raytools import ray_get
from slimecore.rollout.hook_args import SampleHooks, buffer_filter
from slimecore.routing_replay import check_samples, checkpoint_shape
from slimecore.watchdog import LoopThread
from slimecore.runs import write_samples
from slimecore.types import RolloutColumns, Sample, Status

log = logging.getLogger("slimecore.rollout")


class RolloutManager:
    def __init__(self, config_dict: dict, placement_group=None, engine_bundles: list[int] | None = None,
                 tokenizer: bytes | None = None):
        """``tokenizer``: the driver's checked tokenizer, pickled (``slimecore.hf_checkpoint.ship_tokenizer``)."""
        self.config = config = Config.from_dict(config_dict)
        self.fleet, self.router, self.client = None, None, None
        # the engines load their model while this actor loads the plugins, the tokenizer and the data source
        engines = self._launch_engines(placement_group, engine_bundles) if config.starts_engines else None
        import torch

        torch.set_num_threads(1)
        self.hooks = load_for_config(config)
        self.hooks.slime_startup(config=config, process="rollout")
        router = self._spawn_router() if engines is not None else None
        try:
            from slimecore.hf_checkpoint import load_tokenizer

            self.tokenizer = load_tokenizer(config.hf_checkpoint, shipped=tokenizer)
            self.data_source = self.hooks.slime_data_source(config=config, tokenizer=self.tokenizer,
                                                            buffer_filter=buffer_filter(self.hooks, config))
            self.sample_hooks = SampleHooks(self.hooks)
            self.loop = LoopThread(aio.new_event_loop())  # on its own thread: deadlines hold when it is blocked
            self._states: dict[int, dict] = {}  # data-source state after each generated step (for checkpoints)
            self._eval_sources: dict[str, object] = {}
            self._retries_logged = 0
            if engines is not None:
                self._start_engines(engines.result(), router)
        except BaseException:
            if router is not None and self.fleet is None:
                router.stop()
            raise

    # -- engines ---------------------------------------------------------------------------
    def _launch_engines(self, placement_group, engine_bundles):
        """Start every engine on a thread of its own; the future's result is ``[(handle, url), ...]``."""
        from concurrent.futures import ThreadPoolExecutor

        from slimecore.engines.launch import EngineLauncher

        c = self.config
        engine_bind, self.router_bind, self.api_key = engine_hosts(c, placement_group)
        if c.sglang_args and c.rollout_engine != "sglang":
            log.warning("--sglang-* arguments %s apply to --rollout-engine sglang only; the embedded engine "
                        "ignores them", sorted(c.sglang_args))
        self.launcher = EngineLauncher(c, placement_group, engine_bundles, host=engine_bind, api_key=self.api_key,
                                       log_dir=str(Path(c.log_dir) / "engines") if c.log_dir else None)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimecore-engine-start")
        started = pool.submit(self.launcher.start)
        pool.shutdown(wait=False)  # the thread ends with the start; nothing else runs on it
        return started

    def _spawn_router(self):
        """The router's process, started while the engines load (it takes them once they serve)."""
        from slimecore.engines.router import Router

        # agent sessions send their id as the router's routing key; the manual policy keeps a key on one engine
        policy = "manual" if self.hooks.implementers("slime_agent") else "round_robin"
        if self.config.sglang_router_ip:  # slime's --sglang-router-ip/port: the engines join that router
            return Router([], host=self.config.sglang_router_ip, port=self.config.sglang_router_port,
                          api_key=self.api_key, policy=policy, external=True)
        return Router([], host=self.router_bind, api_key=self.api_key, policy=policy).spawn()

    def _start_engines(self, engines: list, router) -> None:
        """The ``router`` in front of the started ``engines``, the fleet's monitor, the rollout client."""
        from slimecore.engines.fleet import EngineFleet
        from slimecore.rollout.client import RolloutClient

        c = self.config
        self.fleet = EngineFleet(self.launcher, self.launcher.count, router,
                                 health_check=c.use_fault_tolerance,
                                 check_interval=c.rollout_health_check_interval,
                                 check_timeout=c.rollout_health_check_timeout,
                                 first_wait=c.rollout_health_check_first_wait).start(engines)
        self.router = self.fleet.router
        # a request cut off by a dying engine or router is retried until the monitor can have found and replaced
        # it: the client's backoff doubles from 0.2 s to 10 s, so 6 retries span 12 s and each further one 10 s
        repair = c.rollout_health_check_interval + c.rollout_health_check_timeout + 60
        retries = 6 + math.ceil(repair / 10)
        self.client = RolloutClient(self.router.url, tokenizer=self.tokenizer, api_key=self.api_key,
                                    timeout=c.sglang_router_request_timeout_secs,
                                    max_retries=retries if c.use_fault_tolerance else 5)
        if c.use_rollout_routing_replay:
            self.client.routed_experts = checkpoint_shape(c.hf_checkpoint)

    @property
    def engines(self) -> list:
        """``[(handle, url), ...]`` of the engines serving now (a replaced engine has a new handle and URL)."""
        return self.fleet.engines if self.fleet else []

    def weight_endpoints(self) -> list:
        """Where train rank 0 pushes weights (``slimecore.engines.launch.Endpoint`` per engine)."""
        return [self.launcher.endpoint(url) for _, url in self.engines]

    def pause_for_update(self) -> list:
        """Pause generation and flush every engine's cache before a weight update (a call queued behind a
        running ``generate`` waits for it: the manager runs one call at a time); returns the paused engines'
        ``weight_endpoints`` (one call less per step for the driver)."""
        self.loop.run_until_complete(self.client.pause_for_update())
        return self.weight_endpoints()

    def resume_after_update(self, version: int, trainer_push: bool = False, expected: dict | None = None) -> None:
        """``trainer_push``: the trainers pushed ``version`` themselves (they can push again to an engine
        restarted while no engine serves the pushed weights, slimecore.engines.fleet). ``expected``: the
        checksums of what the trainer sent, which every engine must report before it resumes (--check-weights)."""
        if expected is not None:
            self.check_weights(expected, version)
        self.client.policy_version = version  # what the engines serve from now on (fully-async staleness)
        if self.fleet:
            self.fleet.trainers_push = self.fleet.trainers_push or trainer_push
            self.fleet.admit_pushed(str(version))
        self.loop.run_until_complete(self.client.continue_generation())

    # called in the REPUSH concurrency group, while a step runs in the default one (slimecore.weight_updates)
    def repush_request(self, wait: float) -> list:
        """The endpoints of the engines waiting for the trainers to push their weights again, ``[]`` if none
        within ``wait`` seconds."""
        return [self.launcher.endpoint(url) for url in self.fleet.repush_request(wait)] if self.fleet else []

    def repushed(self, version: int, expected: dict | None = None, urls: list[str] | None = None) -> None:
        """The trainers pushed ``version`` to the restarted engines at ``urls``; with ``expected`` (their checksums
        of it) those engines, still out of the router, are checked before they go back in."""
        if expected is not None:
            self.check_weights(expected, version, urls)
        self.fleet.repushed(str(version))

    def check_weights(self, expected: dict[str, str], version: int, urls: list[str] | None = None) -> None:
        """The weight-sync sentinel (``slimecore.weight_check``): every engine (or ``urls``) reports the checksum of
        what it serves through SGLang's ``/weights_checker``; one that differs from ``expected`` stops the run."""
        from slimecore.weight_check import check_engines

        start = time.perf_counter()
        if urls is None:  # the engines in the router
            urls = self.loop.run_until_complete(self.client.worker_urls())
        compared = check_engines(expected, urls, str(version), every_name=self.config.rollout_engine != "sglang",
                                 api_key=self.client.api_key, timeout=self.config.ray_timeout)
        log.info("weight check v%s: %d engine(s) hold the %d tensor(s) compared (%.3fs)", version, len(urls),
                 compared, time.perf_counter() - start)

    def release_memory(self) -> None:
        """--offload-rollout: every engine frees its weights and KV cache while the trainer trains."""
        self.loop.run_until_complete(self.client.flush_cache())
        self.loop.run_until_complete(self.client.on_every_engine("/release_memory_occupation", {}))

    def resume_memory(self, tags: list[str]) -> None:
        """SGLang's order: ``["weights"]`` before the update, ``["kv_cache", "cuda_graph"]`` after it."""
        self.loop.run_until_complete(self.client.on_every_engine("/resume_memory_occupation", {"tags": tags}))

    def update_weights(self, weights, version: int, expected: dict | None = None) -> float:
        """Load new weights into every engine: ``[ref]`` to a name->tensor dict in the object store (each
        engine fetches it once), or, for disk transport, a safetensors directory. Returns seconds taken."""
        start = time.perf_counter()
        self.pause_for_update()
        self.fleet.update_weights(weights, str(version), self.config.ray_timeout)
        self.resume_after_update(version, expected=expected)
        return time.perf_counter() - start

    # -- one step --------------------------------------------------------------------------
    def generate(self, rollout_id: int, dp_size: int):
        """Run the rollout for ``rollout_id``; return (per-DP-rank object refs or None, metrics)."""
        c = self.config
        start, wall_start = time.perf_counter(), time.time()
        if c.load_debug_rollout_data:
            samples, metrics = self._load_debug(rollout_id), {}
        else:
            out = self.loop.run_until_complete(
                self.hooks.slime_rollout(config=c, rollout_id=rollout_id, data_source=self.data_source,
                                         client=self.client, sample_hooks=self.sample_hooks, evaluation=False),
                timeout=c.rollout_timeout, what=f"rollout {rollout_id} (--rollout-timeout)")
            samples, metrics = [s for group in out.samples for s in group], dict(out.metrics)
        self._states[rollout_id] = (out.data_state if not c.load_debug_rollout_data and out.data_state is not None
                                    else self.data_source.state_dict())
        for old in [k for k in self._states if k < rollout_id - 2]:
            del self._states[old]
        check_reward_failures(c, samples, rollout_id)
        metrics.update(rollout_metrics(samples, time.perf_counter() - start, c.reward_key))
        metrics.update(self._fault_metrics())
        metrics.update({"timeline/rollout_start": wall_start, "timeline/rollout_end": time.time()})
        if c.save_debug_rollout_data:
            self._save_debug(rollout_id, samples)
        self.hooks.slime_log_rollout(config=c, rollout_id=rollout_id, samples=samples, metrics=metrics)
        write_samples(c, rollout_id, samples)  # samples.jsonl in the run folder (--log-samples)
        if c.debug_rollout_only:
            return None, metrics
        return self._to_train_refs(samples, dp_size), metrics

    def _fault_metrics(self) -> dict[str, float]:
        """Engine and router restarts and retried requests since the last step (slimecore.engines.fleet)."""
        if self.fleet is None:
            return {}
        self.fleet.check()
        retries, self._retries_logged = self.client.retries - self._retries_logged, self.client.retries
        return {**self.fleet.metrics(), "rollout/request_retries": float(retries)}

    def _to_train_refs(self, samples: list[Sample], dp_size: int) -> list:
        from slimecore.rollout.schedule import split_rollout_data

        data = convert_samples(self.hooks, self.config, samples)
        return [ray.put(part) for part in split_rollout_data(self.config, data, dp_size)]

    # -- eval ------------------------------------------------------------------------------
    def eval(self, rollout_id: int) -> dict[str, float]:
        """Every eval data set (``slimecore.rollout.evaluation``) through ``slime_rollout(evaluation=True)``."""
        from slimecore.data.source import make_eval_source
        from slimecore.rollout.evaluation import eval_datasets, eval_metrics

        metrics: dict[str, float] = {}
        versions: set[str] = set()
        for dataset in eval_datasets(self.config):
            config = dataset.apply(self.config)
            if dataset.name not in self._eval_sources:
                source = make_eval_source(config, self.tokenizer, dataset.path)
                if dataset.rm_type:
                    for record in source.records:
                        record["metadata"] = {**(record.get("metadata") or {}), "rm_type": dataset.rm_type}
                self._eval_sources[dataset.name] = source
            source = self._eval_sources[dataset.name]
            out = self.loop.run_until_complete(self.hooks.slime_rollout(
                config=config, rollout_id=rollout_id, data_source=source, client=self.client,
                sample_hooks=self.sample_hooks, evaluation=True))
            metrics.update(eval_metrics(dataset.name, out.samples, config.reward_key))
            versions.update(v for group in out.samples for s in group for v, _ in s.weight_version_spans if v)
        # the weights the eval ran on, as its samples report them (the async loops generate ahead of training)
        numeric = sorted(int(v) for v in versions if v.lstrip("-").isdigit())
        stated = numeric[0] if len(numeric) == 1 else self.client.policy_version
        if len(numeric) > 1:
            log.warning("eval at step %d mixed weight versions %s (an update reached the engines during it)",
                        rollout_id, numeric)
        log.info("eval at step %d on weights v%d", rollout_id, stated)
        metrics["eval/weight_version"] = float(stated)
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
        self.hooks.slime_shutdown(config=self.config, process="rollout")
        if self.client and not self.loop.blocked():
            self.loop.run_until_complete(self.client.close(), timeout=60, what="closing the engines' HTTP sessions")
        self.loop.close()
        if self.fleet:
            self.fleet.stop()


def engine_hosts(config: Config, placement_group) -> tuple[str, str, str | None]:
    """(address engines bind, address the router binds, API key). One node: 127.0.0.1 and no key. Reachable
    from other nodes (a run spanning nodes, or ``--rollout-host``): each engine binds its own node's address
    (``"node"``), the router this node's, and a fresh per-run key guards every engine and router request."""
    import secrets

    from slimecore.raytools import is_multi_node, node_address, spans_nodes

    if config.rollout_host:
        host = config.rollout_host
        return host, host, None if host in ("127.0.0.1", "localhost") else secrets.token_urlsafe(32)
    if spans_nodes(placement_group) or is_multi_node():  # keyed even where a node's address is a loopback one
        return "node", node_address(), secrets.token_urlsafe(32)
    return "127.0.0.1", "127.0.0.1", None


def convert_samples(hooks, config: Config, samples: list[Sample]) -> RolloutColumns:
    """Samples -> training columns (slime's ``_convert_samples_to_train_data``)."""
    for sample in samples:
        sample.check_aligned()
    raw_rewards, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
    next_id = max([s.rollout_id for s in samples if s.rollout_id is not None], default=-1) + 1
    rollout_ids = []
    for sample in samples:  # a sample without rollout_id is its own rollout
        if sample.rollout_id is None:
            rollout_ids.append(next_id)
            next_id += 1
        else:
            rollout_ids.append(sample.rollout_id)
    data: RolloutColumns = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": [[0] * s.response_length if s.remove_sample else
                       list(s.loss_mask if s.loss_mask is not None else [1] * s.response_length) for s in samples],
        "rewards": [float(r) for r in rewards],
        "raw_rewards": [float(r) for r in raw_rewards],
        "rollout_ids": rollout_ids,
        "sample_indices": [s.index for s in samples],
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "weight_versions": [s.oldest_weight_version() for s in samples],  # staleness counts from the oldest token
    }
    if all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [list(s.rollout_log_probs) for s in samples]
    if config.use_rollout_routing_replay:
        check_samples(samples)
        data["rollout_routed_experts"] = [s.rollout_routed_experts for s in samples]
    for key in sorted({key for s in samples for key in s.train_columns}):  # plugins' own columns
        if key in data:
            raise ValueError(f"Sample.train_columns[{key!r}] would replace the core's training column {key!r}; "
                             "the plugin that sets it must pick another name")
        data[key] = [s.train_columns.get(key) for s in samples]
    return data


def rollout_metrics(samples: list[Sample], rollout_time: float, reward_key: str | None = None) -> dict[str, float]:
    """slime-named rollout metrics: rewards, lengths, truncation, throughput."""
    if not samples:
        return {"perf/rollout_time": rollout_time}
    lengths = [s.response_length for s in samples]
    rewards = [s.get_reward_value(reward_key) for s in samples if s.reward is not None and s.status != Status.FAILED]
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
