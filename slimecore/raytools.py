"""Ray start-up and waits that never hang silently."""

from __future__ import annotations

import json
import logging
import os
import time

import ray
import ray.util
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group

from slimecore.config import Config, ConfigError

log = logging.getLogger("slimecore.ray")


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
    """Join the cluster at ``--ray-address`` / ``RAY_ADDRESS`` (as under ``ray job submit``), else start a
    local Ray instance sized to this machine. A joined cluster is used as it is: nothing cluster-wide
    (CPUs, object store, dashboard) is set, and no second instance is ever started."""
    if ray.is_initialized():
        return
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    debug = config.log_level == "debug"
    if not debug:  # the actors' "Loading weights" / "Writing model shards" bars (transformers, huggingface_hub)
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # would interleave with the run's own lines: on only for debug
    ray_log_level = logging.INFO if debug else logging.WARNING  # Ray's "Started a local Ray instance" banner
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if joins_cluster(config):  # the cluster's workers get these variables through the job's runtime env
        address = config.ray_address or os.environ["RAY_ADDRESS"]
        runtime_env = {"env_vars": {k: os.environ[k] for k in set(env) - _job_env_vars()}}
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env, logging_level=ray_log_level)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        log.info("joined the Ray cluster at %s: %d node(s), %s", address, len(nodes),
                 {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})
        return
    # a local instance's processes inherit this environment, so no runtime env: with one, Ray starts every worker
    # afresh for the job instead of using the ones it prestarted (the first actors ran ~0.8 s later here).
    # address="local": a new instance even where `ray start` left a cluster running on this machine, which a bare
    # ray.init() would join (and then refuse num_cpus); joining one takes --ray-address or RAY_ADDRESS
    log.info("starting a local Ray instance (%d CPUs)", local_cpus())
    started = time.perf_counter()
    ray.init(address="local", num_cpus=local_cpus(), include_dashboard=False, log_to_driver=True,
             logging_level=ray_log_level,
             object_store_memory=int(os.environ.get("SLIMECORE_OBJECT_STORE_BYTES", 2 * 1024**3)))
    log.info("Started a local Ray instance in %.1f s (its logs: %s)", time.perf_counter() - started, session_logs())


def session_logs() -> str:
    """Where Ray writes its processes' logs in this session: every actor's full output, the progress bars and
    lines the console leaves out (a run folder links it as ``ray-logs``)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs"


def local_cpus() -> int:
    """The CPUs of the Ray instance a run starts itself (no ``--ray-address`` / ``RAY_ADDRESS``)."""
    return max(2, os.cpu_count() or 2)


def joins_cluster(config: Config) -> bool:
    return bool(config.ray_address or os.environ.get("RAY_ADDRESS"))


def _job_env_vars() -> set[str]:
    """The environment variables a ``ray job submit --runtime-env-json`` set: Ray refuses a driver that sets
    any of them again, and the job's own values win."""
    job_config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not job_config:
        return set()
    return set((json.loads(job_config).get("runtime_env") or {}).get("env_vars") or {})


def create_placement(config: Config, roles: list[str] = ("actor",)):
    """One placement group for everything; returns (pg, {role: train bundle indices}, engine bundle indices).

    Every training role (the actor, and e.g. a critic) has the actor's number of ranks. Disaggregated:
    each role's ranks take their own bundles, engines the rest. Colocated: rank i of every role and
    engine i share bundle i (each bundle holds all those actors' CPUs). ``--actor-resources`` /
    ``--rollout-resources`` add custom Ray resources to the train / engine bundles, which pins them to the
    nodes started with those resources. On several nodes, each kind's bundles are ordered by node address
    as slime orders its GPUs, so ranks 0..k share a node and rank 0 comes first.
    """
    if cluster_gpus() > 0:
        return gpu_placement(config, roles)
    bundles, train, engines, what = cpu_bundles(config, roles)
    check_placement(bundles, what)
    pg = placement_group(bundles, strategy="PACK")
    _wait_placement(pg, bundles, config)
    nodes = bundle_nodes(pg)
    if len(set(nodes)) > 1:
        train = {role: sorted(indices, key=lambda i: (nodes[i], i)) for role, indices in train.items()}
        engines = sorted(engines, key=lambda i: (nodes[i], i))
        log.info("placement over %d nodes: %s", len(set(nodes)),
                 {role: [nodes[i][0] for i in indices] for role, indices in {**train, "engines": engines}.items()})
    return pg, train, engines


def cpu_bundles(config: Config, roles: list[str]) -> tuple[list[dict], dict[str, list[int]], list[int], str]:
    """Without GPUs: the bundles, {role: train bundle indices}, the engine bundle indices, and what they hold."""
    c = config
    n_train = 0 if c.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    no_engines = not c.starts_engines
    n_engines = 0 if no_engines else max(1, c.rollout_num_gpus // c.rollout_num_gpus_per_engine)
    train_bundle = {"CPU": c.num_cpus_per_actor, **(c.actor_resources or {})}
    engine_bundle = {"CPU": c.num_cpus_per_actor, **(c.rollout_resources or {})}
    if c.colocate:
        size = max(n_train, n_engines)
        bundles = [{**train_bundle, **engine_bundle, "CPU": c.num_cpus_per_actor * (len(roles) + 1)}] * size
        train = {role: list(range(n_train)) for role in roles}
        engines = list(range(n_engines))
    else:
        bundles = [train_bundle] * (n_train * len(roles)) + [engine_bundle] * n_engines
        train = {role: list(range(k * n_train, (k + 1) * n_train)) for k, role in enumerate(roles)}
        engines = list(range(n_train * len(roles), len(bundles)))
    return bundles, train, engines, f"{n_train} train rank(s) x {len(roles)} role(s) and {n_engines} engine(s)"


# -- GPUs ------------------------------------------------------------------------------------------
# As slime: one bundle per GPU; a train rank takes 0.4 of its GPU (a critic rank another 0.4), an engine
# 0.2 of its first GPU, so all three fit one bundle when colocated. Ray does not hide the other GPUs
# (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): an engine spans ``--rollout-num-gpus-per-engine`` GPUs
# from ``base_gpu_id``, and CUDA IPC handles name the same device in trainer and engine.
TRAIN_GPU_SHARE, ENGINE_GPU_SHARE = 0.4, 0.2
GPU_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "NCCL_CUMEM_ENABLE": "0"}


def cluster_gpus() -> float:
    return ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0


def gpu_placement(config: Config, roles: list[str] = ("actor",)):
    """slime's layout: ``actor GPUs + rollout GPUs`` bundles (``max`` of the two with ``--colocate``) of one
    GPU each, sorted by node address then GPU id so logical GPU k is the same physical GPU every run.
    Every training role uses the actor's GPUs; engine i starts on logical GPU
    ``offset + i * --rollout-num-gpus-per-engine`` (offset: the actor's GPUs, 0 when colocated)."""
    c = config
    n_train = 0 if c.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    no_engines = not c.starts_engines
    n_rollout = 0 if no_engines else c.rollout_num_gpus
    size, offset = (max(n_train, n_rollout), 0) if c.colocate else (n_train + n_rollout, n_train)
    bundles = [{"GPU": 1, "CPU": c.num_cpus_per_actor * (len(roles) + 1)}] * size
    pg = placement_group(bundles, strategy="PACK")
    _wait_placement(pg, bundles, c)
    order = _bundles_by_gpu(pg, size, c.ray_timeout)
    train = {role: order[:n_train] for role in roles}
    engines = [order[offset + i * c.rollout_num_gpus_per_engine]
               for i in range(n_rollout // c.rollout_num_gpus_per_engine)]
    return pg, train, engines


def bundle_options(pg, bundle: int | None, num_cpus: float, num_gpus: float = 0.0) -> dict:
    """Ray ``.options`` for an actor in bundle ``bundle`` of ``pg`` (None: anywhere), taking ``num_gpus``
    of its GPU when the cluster has GPUs."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict = {"num_cpus": num_cpus}
    if pg is not None and bundle is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    if num_gpus and cluster_gpus() > 0:
        options["num_gpus"] = num_gpus
        options["runtime_env"] = {"env_vars": dict(GPU_ENV)}
    return options


def local_gpu() -> int | None:
    """The GPU Ray gave this actor (physical id; all GPUs stay visible), or None without one."""
    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    return int(ids[0]) if ids else None


class _BundleProbe:
    def where(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), local_gpu()


def _bundles_by_gpu(pg, size: int, timeout: float) -> list[int]:
    """Bundle indices sorted by (node address, GPU id), found by a throw-away actor in each bundle."""
    probe = ray.remote(_BundleProbe)
    actors = [probe.options(**bundle_options(pg, i, 0, 0.01)).remote() for i in range(size)]
    try:
        places = ray_get([a.where.remote() for a in actors], f"{size} placement probes to report their GPU", timeout)
    finally:
        for actor in actors:
            ray.kill(actor)
    return sorted(range(size), key=lambda i: (tuple(int(p) for p in places[i][0].split(".") if p.isdigit()),
                                                places[i][1]))


def _wait_placement(pg, bundles: list[dict], c: Config) -> None:
    ray_get(pg.ready(), f"a placement group of {len(bundles)} bundles {bundles[:1]} (is the cluster big enough? "
            "lower --num-cpus-per-actor or the number of ranks/engines)", min(c.ray_timeout, 120))


def node_address() -> str:
    """The address Ray knows this process's node by: its node record's ``NodeManagerAddress`` (the raylet's
    ``--node-ip-address``). A multi-node run's engines bind it and the router registers exactly it, so the other
    nodes reach them where Ray does; ``ray.util.get_node_ip_address()`` may infer another address of the host."""
    node = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)


def is_multi_node() -> bool:
    """More than one live node in the Ray cluster: engines and router must then be reachable from others."""
    return sum(1 for node in ray.nodes() if node.get("Alive")) > 1


def bundle_nodes(pg) -> list[tuple[str, str]]:
    """``(node address, node id)`` of each bundle of a ready placement group, in bundle order."""
    by_bundle = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [(address.get(by_bundle[i], ""), by_bundle[i]) for i in range(len(by_bundle))]


def spans_nodes(pg) -> bool:
    return pg is not None and len({node for _, node in bundle_nodes(pg)}) > 1


def check_placement(bundles: list[dict], what: str, nodes: list[dict] | None = None) -> None:
    """The placement group's total demand against the cluster's resources (``nodes``: each node's, by default
    the running cluster's): a run the cluster cannot hold fails at once naming the resource, instead of
    waiting for a placement that never comes."""
    have = ray.cluster_resources() if nodes is None else {}
    for node in nodes or []:
        for resource, amount in node.items():
            have[resource] = have.get(resource, 0.0) + amount
    need: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0.0) + amount
    short = {r: n for r, n in need.items() if n > have.get(r, 0.0) + 1e-9}
    if short:
        lines = ", ".join(f"{n:g} {r} (the cluster has {have.get(r, 0.0):g})" for r, n in short.items())
        raise ConfigError(f"the cluster cannot hold this run: {what} need {lines}. Lower --num-cpus-per-actor or the "
                          "number of ranks/engines (--actor-num-gpus-per-node, --rollout-num-gpus), or add nodes")
    if nodes is None:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    for bundle in bundles:
        if nodes and not any(all(node.get(r, 0.0) + 1e-9 >= n for r, n in bundle.items()) for node in nodes):
            raise ConfigError(f"the cluster cannot hold this run: one bundle needs {bundle} on a single node and no "
                              "node has that much. Lower --num-cpus-per-actor, or add a bigger node")
