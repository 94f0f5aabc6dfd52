"""SGLang's weight-sync wire judged by SGLang's own code: the trainer's ``/update_weights_from_tensor`` body
(flattened buckets of its exported weights, one payload per engine TP rank) is opened in another process by the
installed ``sglang`` wheel's ``MultiprocessingSerializer`` and ``FlattenedTensorBucket``
(``slimecore.testing.sglang_wire``)
and every tensor equals the trainer's bit for bit. On the CPU the flattened bucket travels as shared memory
(torch's file_system strategy, as the sender sets it); on CUDA (marked gpu) as CUDA IPC handles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from devices import DEVICES
from slimecore.config import Config
from slimecore.engines import weight_sync
from slimecore.sglang_schema import sglang_root

pytestmark = pytest.mark.skipif(sglang_root() is None, reason="the sglang wheel is not installed (scripts/setup.sh)")


def _payload_buffer(bucket, device: str) -> torch.Tensor | None:
    """Where the sender flattens a bucket: a shared-memory buffer on the CPU, a fresh tensor on CUDA."""
    if device != "cpu":
        return None
    buffer = torch.empty(sum(t.numel() * t.element_size() for _, t in bucket), dtype=torch.uint8)
    with weight_sync.file_system_sharing():
        buffer.share_memory_()
    return buffer


def _mixed_bucket(device: str) -> weight_sync.NamedTensors:
    """Odd-length narrow tensors before wide ones: packed back to back in this order, the fp32 and int64 spans
    would start at offsets SGLang's ``reconstruct_tensors`` cannot view as their dtype."""
    g = torch.Generator().manual_seed(0)
    return [("x.bf16", torch.randn(7, 5, generator=g).to(device, torch.bfloat16)),
            ("x.fp32", torch.randn(3, 3, generator=g).to(device)),
            ("x.uint8", torch.arange(5, dtype=torch.uint8).to(device)),
            ("x.fp16", torch.randn(3, generator=g).to(device, torch.float16)),
            ("x.int64", torch.arange(11, device=device)),
            ("x.bf16b", torch.randn(1, generator=g).to(device, torch.bfloat16))]


def test_a_mixed_dtype_bucket_round_trips_through_sglangs_flattened_tensor_bucket():
    """Both ends in SGLang's own class, in process: the tensor path's flattened bucket and metadata rebuilt by
    ``FlattenedTensorBucket(flattened_tensor=, metadata=)``, and the distributed path's broadcast bytes landing in
    the bucket SGLang builds from the ``/update_weights_from_distributed`` body (``named_tensors=`` of empty
    tensors), give back every tensor bit for bit. Packed in the caller's order, SGLang's class fails on this
    bucket itself (its own producer included)."""
    from slimecore.testing.sglang_wire import sglang_wire

    wire, bucket = sglang_wire(), _mixed_bucket("cpu")
    with pytest.raises(RuntimeError, match="must be divisible"):
        wire.FlattenedTensorBucket(named_tensors=bucket).reconstruct_tensors()
    want = weight_sync.digest(bucket)
    flat, metadata = weight_sync.flatten(bucket)
    assert flat.numel() == sum(t.numel() * t.element_size() for _, t in bucket)  # nothing between the spans
    got = wire.FlattenedTensorBucket(flattened_tensor=flat, metadata=[
        wire.FlattenedTensorMetadata(**vars(m)) for m in metadata]).reconstruct_tensors()
    assert weight_sync.digest(got) == want and len(got) == len(bucket)
    body = weight_sync.distributed_body(bucket, "g", "1")
    receiving = wire.FlattenedTensorBucket(named_tensors=[
        (name, torch.empty(shape, dtype=getattr(torch, dtype)))
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"])])
    receiving.get_flattened_tensor().copy_(flat)  # what the broadcast does
    assert weight_sync.digest(receiving.reconstruct_tensors()) == want
    # the embedded engine's receiver lays the body out the same way
    layout = weight_sync.layout(body["names"], body["dtypes"], body["shapes"])
    assert [(m.start_idx, m.end_idx) for m in layout] == [(m.start_idx, m.end_idx) for m in metadata]


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_opens_the_trainers_flattened_buckets_bit_for_bit(tiny_checkpoint, tmp_path, device):
    from slimecore.trainers.fsdp import FSDPBackend

    backend = FSDPBackend(Config.make(hf_checkpoint=str(tiny_checkpoint)), device=device)
    buckets = list(backend.hf_weight_buckets(256 * 1024))  # the trainer's export: several buckets
    buckets.append(_mixed_bucket(device))  # and the dtypes a bf16 or quantised export carries, narrowest first
    assert len(buckets) > 2 and all(t.device.type == device for b in buckets for _, t in b)
    keep = []  # the sender holds each flattened bucket until the engines answered
    for i, bucket in enumerate(buckets):
        flat, metadata = weight_sync.flatten(bucket, out=_payload_buffer(bucket, device))
        keep.append(flat)
        payloads = [weight_sync.serialize({"flattened_tensor": flat, "metadata": metadata}) for _ in range(2)]
        body_file, out_file = tmp_path / f"body{i}.json", tmp_path / f"digests{i}.json"
        body_file.write_text(json.dumps(weight_sync.tensor_body(payloads, "1")))  # two engine TP ranks
        subprocess.run([sys.executable, "-m", "slimecore.testing.sglang_wire", str(body_file), str(out_file)],
                       check=True, timeout=300)
        want = weight_sync.digest(bucket)
        for rank in json.loads(out_file.read_text()):
            assert rank["digests"] == want and rank["devices"] == [device]


@pytest.mark.parametrize("device", DEVICES)
def test_sglangs_process_group_helper_joins_the_weight_group_and_receives_buckets(tiny_checkpoint, tmp_path, device):
    """The distributed path: SGLang's own ``init_custom_process_group`` (rank 1) joins the group the trainer makes
    (``weight_sync.init_weight_group``, rank 0; gloo on the CPU, NCCL on CUDA), and each broadcast flattened bucket,
    described by the trainer's ``/update_weights_from_distributed`` body, arrives intact in SGLang's
    ``FlattenedTensorBucket``."""
    from slimecore.engines.router import free_port
    from slimecore.trainers.fsdp import FSDPBackend

    backend = FSDPBackend(Config.make(hf_checkpoint=str(tiny_checkpoint)), device=device)
    buckets = list(backend.hf_weight_buckets(256 * 1024)) + [_mixed_bucket(device)]
    bodies = [weight_sync.distributed_body(bucket, "wire-test", "1") for bucket in buckets]
    (tmp_path / "bodies.json").write_text(json.dumps(bodies))
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-m", "slimecore.testing.sglang_wire", "--distributed", "127.0.0.1",
                                 str(port), device, str(tmp_path / "bodies.json"), str(tmp_path / "digests.json")])
    try:
        group = weight_sync.init_weight_group("nccl" if device == "cuda" else "gloo", "127.0.0.1", port, 0, 2,
                                              "wire-test", timeout=120)
        for bucket in buckets:
            flat, _ = weight_sync.flatten(bucket)
            weight_sync.broadcast(group, flat)
        assert receiver.wait(timeout=120) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
    received = json.loads((tmp_path / "digests.json").read_text())
    assert len(received) == len(buckets) > 1
    for got, bucket in zip(received, buckets):
        assert got["digests"] == weight_sync.digest(bucket)
