"""Ray start-up and waits that never hang silently."""

from __future__ import annotations

import os

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group

from slimecore.config import Config


class RayWaitTimeout(TimeoutError):
    """A Ray wait ran past its limit; the message names what was being waited for."""


def ray_get(refs, what: str, timeout: float):
    """``ray.get`` with a timeout whose error says what we waited for and how to raise the limit."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise RayWaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; check the actor logs above, "
                             "or raise --ray-timeout if the work is simply slow") from None


def init_ray(config: Config) -> None:
    if ray.is_initialized():
        return
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=True,
             object_store_memory=int(os.environ.get("SLIMECORE_OBJECT_STORE_BYTES", 2 * 1024**3)),
             runtime_env={"env_vars": {k: os.environ[k] for k in env}})


def create_placement(config: Config, roles: list[str] = ("actor",)):
    """One placement group for everything; returns (pg, {role: train bundle indices}, engine bundle indices).

    Every training role (the actor, and e.g. a critic) has the actor's number of ranks. Disaggregated:
    each role's ranks take their own bundles, engines the rest. Colocated: rank i of every role and
    engine i share bundle i (each bundle holds all those actors' CPUs).
    """
    c = config
    n_train = 0 if c.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    no_engines = c.debug_train_only or c.load_debug_rollout_data
    n_engines = 0 if no_engines else max(1, c.rollout_num_gpus // c.rollout_num_gpus_per_engine)
    if c.colocate:
        size = max(n_train, n_engines)
        bundles = [{"CPU": c.num_cpus_per_actor * (len(roles) + 1)}] * size
        train = {role: list(range(n_train)) for role in roles}
        engines = list(range(n_engines))
    else:
        bundles = [{"CPU": c.num_cpus_per_actor}] * (n_train * len(roles) + n_engines)
        train = {role: list(range(k * n_train, (k + 1) * n_train)) for k, role in enumerate(roles)}
        engines = list(range(n_train * len(roles), len(bundles)))
    from slimecore.preflight import check_placement

    check_placement(bundles, f"{n_train} train rank(s) x {len(roles)} role(s) and {n_engines} engine(s)")
    pg = placement_group(bundles, strategy="PACK")
    ray_get(pg.ready(), f"a placement group of {len(bundles)} bundles {bundles[:1]} (is the cluster big enough? "
            "lower --num-cpus-per-actor or the number of ranks/engines)", min(c.ray_timeout, 120))
    return pg, train, engines
