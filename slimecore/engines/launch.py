"""The per-engine lifecycle, the same for both engine kinds (``--rollout-engine embedded | sglang``).

``EngineLauncher.start([i, ...])`` starts engine i in its placement bundle and returns ``(actor, url)``
once it serves; ``stop(actor)`` shuts it down; ``endpoint(url)`` is what train rank 0 needs to push
weights to it. Starting engine i again after it died gives a fresh server on a new port: register the new
URL with the router, and the next weight push reaches it (the sender makes a new weight-update group when
the engine set changes). Each actor answers ``health(timeout)`` and ``shutdown()``.

Ray is imported where the launcher uses it: train rank 0 imports :class:`Endpoint` from here
(``slimecore.trainers.weight_sender``), and a trainer runs without Ray (a GPU machine with torch alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slimecore.config import Config, torch_threads
from slimecore.engines.fleet import post_update_weights_from_disk


@dataclass(frozen=True)
class Endpoint:
    """How train rank 0 reaches one engine (``slimecore.trainers.weight_sender``): its URL, its TP size (ranks
    in a weight group) and the run's API key (None on a one-node run). Defined here, with no torch: the driver
    unpickles the endpoints the rollout manager returns, and needs no torch for it."""

    url: str
    tp_size: int = 1
    api_key: str | None = None


class EngineLauncher:
    def __init__(self, config: Config, placement_group=None, bundles: list[int] | None = None,
                 host: str = "127.0.0.1", api_key: str | None = None, log_dir: str | None = None):
        self.config, self.placement_group, self.host, self.api_key = config, placement_group, host, api_key
        self.count = max(1, config.rollout_num_gpus // config.rollout_num_gpus_per_engine)
        self.bundles = list(bundles) if bundles is not None else [None] * self.count
        if len(self.bundles) < self.count:
            raise ValueError(f"{self.count} engines need {self.count} bundle indices, got {self.bundles}")
        self.log_dir = log_dir

    def _actor(self, index: int):
        import ray

        from slimecore.raytools import ENGINE_GPU_SHARE, bundle_options

        c = self.config
        options = bundle_options(self.placement_group, self.bundles[index], c.num_cpus_per_actor, ENGINE_GPU_SHARE)
        if c.rollout_engine == "sglang":
            from slimecore.engines.sglang import SGLangEngineActor

            return ray.remote(SGLangEngineActor).options(**options).remote(
                c.to_dict(), index, host=self.host, api_key=self.api_key, log_dir=self.log_dir)
        from slimecore.engines.embedded_actors import EmbeddedEngineActor

        return ray.remote(EmbeddedEngineActor).options(**options).remote(
            c.hf_checkpoint, seed=c.seed + index, num_threads=torch_threads(c), host=self.host, api_key=self.api_key,
            return_routed_experts=c.use_rollout_routing_replay)

    def start(self, indices: list[int] | None = None) -> list[tuple[object, str]]:
        """Start engines ``indices`` (default: all) together; ``[(actor, url), ...]`` once every one serves."""
        import ray

        from slimecore.raytools import ray_get

        indices = list(range(self.count)) if indices is None else indices
        actors = [self._actor(i) for i in indices]
        wait = self.config.ray_timeout
        if self.config.rollout_engine == "sglang":
            wait = max(wait, self.config.sglang_startup_timeout + 60)
        try:
            urls = ray_get([a.start.remote() for a in actors],
                           f"{len(actors)} {self.config.rollout_engine} engine(s) {indices} to serve "
                           f"{self.config.hf_checkpoint}", wait)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return list(zip(actors, urls))

    def stop(self, actor, timeout: float = 60) -> None:
        """Shut the server down (SGLang: its whole process group), then the actor."""
        import ray

        try:
            ray.get(actor.shutdown.remote(), timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # already dead: killing the actor below is all there is left to do
        ray.kill(actor)

    # -- the lifecycle slimecore.engines.fleet drives (health checks, restarts) -------------------------
    def load_weights(self, actor, url: str, weights, version: str) -> None:
        """Give a (re)started engine the weights ``RolloutManager.update_weights`` last got: ``[ref]`` to a
        name->tensor dict in the object store, or a directory (``/update_weights_from_disk``). Weights pushed
        by train rank 0 (tensor / distributed) reach a restarted engine with the next push."""
        if isinstance(weights, (str, Path)):
            post_update_weights_from_disk(url, str(weights), version, api_key=self.api_key)
        else:
            import ray

            ray.get(actor.load_weights.remote(weights[0], version))

    def shutdown(self, actor) -> None:
        """Stop at once, even a hung engine (its actor cannot answer a polite shutdown)."""
        self.stop(actor, timeout=5)

    def endpoint(self, url: str) -> Endpoint:
        """The :class:`Endpoint` of the engine at ``url``."""
        tp_size = self.config.rollout_num_gpus_per_engine if self.config.rollout_engine == "sglang" else 1
        return Endpoint(url, tp_size, self.api_key)
