"""GPU placement as slime places it, on a local Ray that declares fake GPUs (no CUDA needed).

Each layout runs in its own process (its own Ray with ``num_gpus`` on the head). Train ranks, critic ranks
and engines are probed through the same ``bundle_options`` the real actors use, and report the GPU Ray
gave them (``local_gpu``: the device a train rank sets, the engine's ``base_gpu_id``) and the
``CUDA_VISIBLE_DEVICES`` they see (unset: every GPU stays visible, as slime's NOSET setting does)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, sys
import ray
from slimecore.config import parse_config
from slimecore.raytools import (ENGINE_GPU_SHARE, TRAIN_GPU_SHARE, bundle_options, create_placement, local_gpu)

num_gpus, argv = int(sys.argv[1]), sys.argv[2:]
ray.init(address="local", num_cpus=16, num_gpus=num_gpus, include_dashboard=False, object_store_memory=128 << 20,
         log_to_driver=False)
config = parse_config(["--rollout-batch-size", "1", *argv], [], {})

@ray.remote
class Probe:
    def where(self):
        return local_gpu(), os.environ.get("CUDA_VISIBLE_DEVICES")

pg, train, engines = create_placement(config, ["actor", "critic"])
def probe(bundles, share):
    actors = [Probe.options(**bundle_options(pg, b, config.num_cpus_per_actor, share)).remote() for b in bundles]
    return ray.get([a.where.remote() for a in actors], timeout=120)
print(json.dumps({"bundles": pg.bundle_specs, "actor": probe(train["actor"], TRAIN_GPU_SHARE),
                  "critic": probe(train["critic"], TRAIN_GPU_SHARE), "engines": probe(engines, ENGINE_GPU_SHARE)}))
"""


def _place(num_gpus: int, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(num_gpus), *flags], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("num_gpus, flags, bundles, actor, engines", [
    # disaggregated: actor GPUs first, then each engine's first GPU
    (6, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"],
     6, [0, 1], [2, 4]),
    # colocated: max(actor, rollout) GPUs, engines from GPU 0
    (4, ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
         "--colocate"], 4, [0, 1, 2, 3], [0, 2]),
    (2, ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--colocate"],
     2, [0, 1], [0, 1]),
])
def test_gpu_bundles_ranks_and_engines(num_gpus, flags, bundles, actor, engines):
    placed = _place(num_gpus, *flags)
    assert len(placed["bundles"]) == bundles and all(b["GPU"] == 1 for b in placed["bundles"])
    assert [gpu for gpu, _ in placed["actor"]] == actor
    assert [gpu for gpu, _ in placed["critic"]] == actor  # a critic shares the actor's GPUs, as in slime
    assert [gpu for gpu, _ in placed["engines"]] == engines  # each engine's base_gpu_id
    assert all(visible is None for _, visible in placed["actor"] + placed["engines"])


def test_the_placement_check_before_ray_asks_no_torch(monkeypatch):
    """Before Ray, a run that starts its own instance checks a CPU placement only where Ray will find no GPU;
    without torch loaded (the driver loads none) GPU device nodes decide, and one means the check is left to
    ``create_placement`` once Ray is up."""
    import glob
    import os

    from slimecore import preflight
    from slimecore.config import Config, ConfigError

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # restored afterwards; the driver has none here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    too_big = Config.make(num_cpus_per_actor=4096)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert not preflight.may_have_gpus()
    with pytest.raises(ConfigError, match="4096"):
        preflight.check_local_placement(too_big, [])
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else [])
    assert preflight.may_have_gpus()
    preflight.check_local_placement(too_big, [])  # a GPU machine: checked after ray.init
    assert "torch" not in sys.modules
