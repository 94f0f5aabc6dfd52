"""Seconds per full weight sync over SGLang's ``/update_weights_from_tensor`` wire, without Ray or a server: the
trainer side flattens and serialises each bucket of a Qwen2.5 shape's weights as ``WeightSender`` does (CUDA IPC
handles on a GPU, shared memory on the CPU); a second process opens each payload with the sglang wheel's own
``MultiprocessingSerializer`` and ``FlattenedTensorBucket`` (``slimecore.testing.sglang_wire``) and copies the
tensors into its own preallocated weights, as an engine loads them; then it answers. The time of one full sync
(the transfer loop: flatten, serialise, open, copy, answer) is the median over ``--repeats`` after one warm-up;
the engine's weights are checked bit for bit against the trainer's at the end.

    python benchmarks/weight_wire.py                       # GPU: qwen2.5-0.5B and 1.5B; CPU: the tiny model
    python benchmarks/weight_wire.py --shapes qwen2.5-1.5B --repeats 5

HTTP and the engine's ``load_weights`` (name mapping, TP sharding) are not included; SGLang's own loader is what
a real engine adds on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def engine(conn, layout: list, device: str) -> None:
    """The receiving process: SGLang's classes open each payload; the tensors are copied into its weights."""
    import torch.multiprocessing as mp

    from slimecore.engines.weight_sync import digest
    from slimecore.testing.sglang_wire import open_payload, sglang_wire

    mp.set_sharing_strategy("file_system")
    wire = sglang_wire()
    weights = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in layout}
    conn.send("ready")
    while (payload := conn.recv()) is not None:
        for name, tensor in open_payload(wire, payload):
            weights[name].copy_(tensor)
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send("ok")
    conn.send(digest(weights.items()))


def build(shape: str, device: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from slimecore.engines.weight_sync import unique_tensors

    if shape == "tiny":
        import tempfile

        from slimecore.testing.tiny import make_tiny_checkpoint

        model = AutoModelForCausalLM.from_pretrained(make_tiny_checkpoint(Path(tempfile.mkdtemp())))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_throughput import SHAPES

        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.bfloat16)
    return dict(unique_tensors((k, v.detach().to(device)) for k, v in model.state_dict().items()))


def sync_seconds(shape: str, device: str, repeats: int, bucket_bytes: int) -> dict:
    import torch.multiprocessing as mp

    from slimecore.engines import weight_sync

    named = build(shape, device)
    buckets = list(weight_sync.bucketize(named.items(), bucket_bytes))
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    layout = [(n, tuple(t.shape), t.dtype) for n, t in named.items()]
    process = ctx.Process(target=engine, args=(theirs, layout, device))
    process.start()
    assert ours.recv() == "ready"
    shared = None
    if device == "cpu":  # the sender's kept shared-memory buffer
        shared = torch.empty(max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets), dtype=torch.uint8)
        with weight_sync.file_system_sharing():
            shared.share_memory_()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for bucket in buckets:
            flat, metadata = weight_sync.flatten(bucket, out=shared)
            ours.send(weight_sync.serialize({"flattened_tensor": flat, "metadata": metadata}))
            assert ours.recv() == "ok"
            if device == "cuda":
                del flat
                torch.cuda.ipc_collect()
        times.append(time.perf_counter() - start)
    ours.send(None)
    received = ours.recv()
    process.join(timeout=60)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    return {"shape": shape, "transport": "cuda-ipc" if device == "cuda" else "shared-memory",
            "seconds": statistics.median(times[1:]), "all_seconds": times, "bytes": nbytes, "buckets": len(buckets),
            "exact": received == weight_sync.digest(named.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=None, help="default: qwen2.5-0.5B qwen2.5-1.5B on a GPU, tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=512 << 20)
    parser.add_argument("--out", default="benchmarks/results/weight_wire.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shapes or (["qwen2.5-0.5B", "qwen2.5-1.5B"] if device == "cuda" else ["tiny"])
    results = [sync_seconds(shape, device, args.repeats, args.bucket_bytes) for shape in shapes]
    for r in results:
        print(f"{r['shape']:14s} {r['transport']:13s} {r['seconds']:.3f} s per full sync ({r['bytes'] / 2**30:.2f} "
              f"GiB, {r['buckets']} buckets), bit-exact: {r['exact']}")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"written to {args.out}")
    if not all(r["exact"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
