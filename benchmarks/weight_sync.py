"""Seconds per weight sync, per protocol: train side (this process) -> one embedded engine (a Ray actor).

    python benchmarks/weight_sync.py --model smollm2 --repeats 5 --out benchmarks/results/weight_sync_smollm2.json

Each protocol pushes the full model ``--repeats`` times (after one warm-up push) and the median is kept:
``tensor`` (/update_weights_from_tensor with the weights in shared memory, as the fsdp trainer keeps them
on CPU: the engine's copy is the only one), ``tensor-copy`` (the same from ordinary memory, as LoRA-merged or
megatron weights: first copied into the sender's shared buffer), ``distributed (/update_weights_from_distributed,
gloo broadcast; the group made once, in the warm-up), ``disk`` (save safetensors + /update_weights_from_disk)
and ``object-store`` (ray.put of the state dict + the engine actor's load_weights). Tensor and distributed
send tied weights once, as the fsdp trainer's export does. Pause/flush/continue
(three small HTTP calls) are not included. Every push is checked bit for bit once at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=512 * 1024**2)
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    parser.add_argument("--protocols", nargs="+", default=["tensor-copy", "tensor", "distributed", "disk",
                                                            "object-store"])
    args = parser.parse_args()
    for key, value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    import ray
    from transformers import AutoModelForCausalLM

    from slimecore.engines import weight_sync
    from slimecore.engines.embedded_actors import launch_embedded_engines
    from slimecore.engines.router import http_json
    from slimecore.trainers.weight_sender import Endpoint, WeightSender

    if args.model == "smollm2":
        from slimecore.hf_checkpoint import resolve_checkpoint

        checkpoint = resolve_checkpoint(None)
    else:
        from slimecore.testing.tiny import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(Path(tempfile.gettempdir()) / "slimecore-bench-tiny", hidden=256, layers=4)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False)
    (actor, url), = launch_embedded_engines(1, str(checkpoint), num_cpus=0.5, timeout=600)
    sender = WeightSender(args.bucket_bytes, timeout=600)
    workdir = Path(tempfile.mkdtemp(prefix="slimecore-bench-weights-"))

    def buckets(named=None):  # what the fsdp trainer exports: tied weights once
        return weight_sync.bucketize(weight_sync.unique_tensors((named or state).items()), args.bucket_bytes)

    copies = {k: v.detach().clone() for k, v in state.items()}  # ordinary memory, tied weights kept tied
    copies.update((k, copies[tied]) for k, tied in _tied_names(state).items())

    def tensor_copy(version):
        sender.push(buckets(copies), [Endpoint(url)], version, "tensor")

    def tensor(version):
        sender.push(buckets(), [Endpoint(url)], version, "tensor")

    def distributed(version):
        sender.push(buckets(), [Endpoint(url)], version, "distributed")

    def disk(version):
        model.save_pretrained(workdir, safe_serialization=True)
        status, out = http_json("POST", url + "/update_weights_from_disk", weight_sync.disk_body(str(workdir), version))
        assert status == 200 and out["success"], out

    def object_store(version):
        ray.get(actor.load_weights.remote(ray.put({k: v.detach() for k, v in state.items()}), version))

    protocols = {"tensor-copy": tensor_copy, "tensor": tensor, "distributed": distributed, "disk": disk,
                 "object-store": object_store}
    results = {}
    for name in args.protocols:
        if name == "tensor":
            weight_sync.share_weights(model)  # the fsdp trainer's layout on CPU
            state = model.state_dict()
        push = protocols[name]
        push(f"{name}-warmup")
        seconds = []
        for i in range(args.repeats):
            start = time.perf_counter()
            push(f"{name}-{i}")
            seconds.append(time.perf_counter() - start)
        assert ray.get(actor.weights_digest.remote()) == weight_sync.digest(state.items()), name
        results[name] = {"median_s": statistics.median(seconds), "all_s": seconds}
        print(f"{name:13s} median {statistics.median(seconds):.3f} s  ({', '.join(f'{s:.3f}' for s in seconds)})")
    sender.close()
    ray.shutdown()
    out = {"model": str(checkpoint), "weight_bytes": nbytes, "bucket_bytes": args.bucket_bytes,
           "repeats": args.repeats, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "load_average_at_end": os.getloadavg(),
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


def _tied_names(state: dict) -> dict[str, str]:
    """name -> the earlier name whose tensor it is (tied embeddings)."""
    first, tied = {}, {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


if __name__ == "__main__":
    main()
