"""The Ray actors of the embedded engine (:mod:`slimecore.engines.embedded`), in a module that imports neither
torch nor transformers: the rollout manager creates its engines before it loads anything heavy, so the
engines' processes start while the manager is still importing (the engine module is imported in the
engine's own process)."""

from __future__ import annotations

from pathlib import Path


class EmbeddedEngineActor:
    """Ray actor holding one EmbeddedServer (create it with ``launch_embedded_engines``). ``host="node"``
    binds the address of the node it runs on (multi-node runs), anything else is used as given."""

    def __init__(self, model_path: str, max_batch_size: int = 64, seed: int = 0, num_threads: int = 1,
                 dtype: str = "float32", host: str = "127.0.0.1", api_key: str | None = None,
                 return_routed_experts: bool = False):
        if host == "node":
            from slimecore.raytools import node_address

            host = node_address()
        import torch

        from slimecore.engines.embedded import EmbeddedServer  # torch and transformers: in the engine's process

        torch.set_num_threads(num_threads)
        self.server = EmbeddedServer(model_path, host=host, max_batch_size=max_batch_size, seed=seed,
                                     num_threads=num_threads, dtype=dtype, api_key=api_key,
                                     return_routed_experts=return_routed_experts)

    def start(self) -> str:
        return self.server.start()

    def load_weights(self, named_tensors, weight_version: str) -> str:
        return self.server.load_weights(named_tensors, weight_version)

    def health(self, timeout: float = 5) -> bool:
        return self.server.ready

    def weights_digest(self) -> dict[str, str]:
        return self.server.weights_digest()

    def shutdown(self) -> None:
        self.server.stop()


class EmbeddedEngines:
    """The lifecycle of the embedded engine actors that ``slimecore.engines.fleet`` drives: engine i runs in
    bundle ``bundle_indices[i]`` of the placement group with seed ``seed + i``; a restarted engine takes
    the same bundle and seed."""

    def __init__(self, model_path: str, num_cpus: float = 0.5, placement_group=None,
                 bundle_indices: list[int] | None = None, timeout: float = 120, seed: int = 0, num_threads: int = 1,
                 max_batch_size: int = 64, host: str = "127.0.0.1"):
        self.model_path, self.num_cpus, self.placement_group = model_path, num_cpus, placement_group
        self.bundle_indices, self.timeout, self.seed = bundle_indices, timeout, seed
        self.num_threads, self.max_batch_size, self.host = num_threads, max_batch_size, host

    def start(self, indices: list[int]) -> list[tuple[object, str]]:
        """Start engines ``indices`` together and wait until all serve; returns ``[(actor, url), ...]``."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slimecore.raytools import ray_get

        if self.placement_group is not None and (self.bundle_indices is None
                                                 or len(self.bundle_indices) <= max(indices, default=-1)):
            raise ValueError(f"engines {list(indices)} in a placement group need a bundle index each, "
                             f"got {self.bundle_indices}")
        actor_cls = ray.remote(EmbeddedEngineActor)
        actors = []
        for i in indices:
            options = {"num_cpus": self.num_cpus}
            if self.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=self.bundle_indices[i])
            actors.append(actor_cls.options(**options).remote(self.model_path, max_batch_size=self.max_batch_size,
                                                              seed=self.seed + i, num_threads=self.num_threads,
                                                              host=self.host))
        urls = ray_get([a.start.remote() for a in actors],
                       f"{len(actors)} embedded engine(s) to load {self.model_path}", self.timeout)
        return list(zip(actors, urls))

    def load_weights(self, actor, url: str, weights, version: str) -> None:
        """Blocking: the weights a ``RolloutManager.update_weights`` got: ``[ref]`` (the object store) or a
        directory, which goes through the engine's ``/update_weights_from_disk`` as on any SGLang server."""
        import ray

        from slimecore.engines.fleet import post_update_weights_from_disk

        if isinstance(weights, (str, Path)):
            post_update_weights_from_disk(url, str(weights), version)
        else:
            ray.get(actor.load_weights.remote(weights[0], version))

    def shutdown(self, actor) -> None:
        """Kill at once (a hung engine cannot answer a polite shutdown); its open connections close."""
        import ray

        ray.kill(actor)


def launch_embedded_engines(n: int, model_path: str, num_cpus: float = 0.5, placement_group=None,
                            bundle_indices: list[int] | None = None, timeout: float = 120, seed: int = 0,
                            num_threads: int = 1, max_batch_size: int = 64) -> list[tuple[object, str]]:
    """Start ``n`` engine actors (engine i in bundle ``bundle_indices[i]`` of the placement group, seed
    ``seed + i``) and wait until all serve; returns ``[(actor, url), ...]``."""
    return EmbeddedEngines(model_path, num_cpus, placement_group, bundle_indices, timeout, seed, num_threads,
                           max_batch_size).start(list(range(n)))
