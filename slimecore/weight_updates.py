"""Driver side of handing the weights (and, colocated, the devices) from the trainer to the engines.

Every update runs as SGLang's clients run it: the rollout manager pauses generation and flushes every
engine's cache, the weights go over the chosen transport with ``weight_version`` = the new policy
version, and generation continues. With ``--offload-rollout`` the engines release their weights and KV
cache while the trainer trains and resume them in SGLang's order (weights, the update, then KV cache);
with ``--offload-train`` the trainer's state leaves the device once the engines need it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

from slimecore.config import Config
from slimecore.raytools import cluster_gpus, ray_get


def resolve_transport(config: Config, endpoints: list) -> str:
    """``--update-weight-transport auto``: tensor when trainer and engines share devices (``--colocate``) or,
    on CPU, a host (every engine on loopback: shared memory is the fastest CPU path,
    ``benchmarks/weight_sync.py``); distributed otherwise, as slime chooses NCCL for disaggregated GPUs."""
    if config.update_weight_transport != "auto":
        return config.update_weight_transport
    if config.colocate:
        return "tensor"
    same_host = all(urlparse(e.url).hostname in ("127.0.0.1", "localhost") for e in endpoints)
    return "tensor" if same_host and cluster_gpus() == 0 else "distributed"


def sync_weights(config: Config, train, rollout, version: int) -> float:
    """Push the trainer's weights to every engine, which then serve ``version``; returns seconds."""
    wait = config.ray_timeout
    checksum = train.checksum_kind()  # --check-weights: the engines' checksums are compared before they resume
    if config.update_weight_transport in ("disk", "object-store"):
        if config.update_weight_transport == "disk":
            weights = train.weights_ref(str(Path(config.log_dir) / "weights" / f"v{version}"))
        else:
            weights = [train.weights_ref()]  # wrapped: the manager passes the ref on instead of fetching it
        expected = train.weight_checksums(checksum) if checksum else None
        seconds = ray_get(rollout.update_weights.remote(weights, version, expected),
                          f"engines to load weights v{version}", wait)
        shutil.rmtree(Path(config.log_dir) / "weights" / f"v{version - 1}", ignore_errors=True)  # keep the newest
        return seconds
    endpoints = ray_get(rollout.pause_for_update.remote(), "the engines to pause and flush before a weight update",
                        wait)
    transport = resolve_transport(config, endpoints)
    figures = train.push_weights(endpoints, version, transport, checksum)
    ray_get(rollout.resume_after_update.remote(version, True, figures.get("checksums")),
            "the engines to check the weights and continue generating", wait)
    return figures["seconds"]


def before_train(config: Config, groups: dict, rollout) -> None:
    """Colocated: the engines give the devices up, the trainer takes them back."""
    if config.offload_rollout:
        ray_get(rollout.release_memory.remote(), "the engines to release their memory", config.ray_timeout)
    if config.offload_train:
        for group in groups.values():
            group.onload()


def after_train(config: Config, groups: dict, rollout, version: int, push: bool) -> float:
    """Colocated: the trainer gives the devices up and the engines resume, the weights of ``version``
    loaded between their weights and their KV cache. ``push``: the weights changed. Released engine weights
    are always pushed again (SGLang keeps no copy of them); returns the sync's seconds."""
    if config.offload_train:
        for group in groups.values():
            group.offload()
    if config.offload_rollout:
        ray_get(rollout.resume_memory.remote(["weights"]), "the engines to resume their weights", config.ray_timeout)
    seconds = sync_weights(config, groups["actor"], rollout, version) if push or config.offload_rollout else 0.0
    if config.offload_rollout:
        ray_get(rollout.resume_memory.remote(["kv_cache", "cuda_graph"]), "the engines to resume their KV cache",
                config.ray_timeout)
    return seconds
