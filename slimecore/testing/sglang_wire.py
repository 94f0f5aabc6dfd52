"""Test and benchmark support: SGLang's own receiving end of ``/update_weights_from_tensor``
(``load_format="flattened_bucket"``), run in a process of its own, as an SGLang TP worker opens the trainer's
payload (``tests/test_weight_wire.py``, ``benchmarks/weight_wire.py``).

    python -m slimecore.testing.sglang_wire BODY.json DIGESTS.json
    python -m slimecore.testing.sglang_wire --distributed ADDRESS PORT DEVICE BODIES.json DIGESTS.json

reads the request body, opens each TP rank's payload with the installed ``sglang`` wheel's own
``MultiprocessingSerializer.deserialize`` (and its ``SafeUnpickler``), rebuilds the tensors through its
``FlattenedTensorBucket`` as ``ModelRunner._update_weights_from_flattened_bucket`` does, and writes each
tensor's SHA-256 (``slimecore.engines.weight_sync.digest``) per payload. With ``--distributed`` it joins the
trainer's weight-update group through SGLang's ``init_custom_process_group`` and receives each
``/update_weights_from_distributed`` body's broadcast bucket (gloo on the CPU, NCCL on CUDA).

The classes are executed from the wheel's source files (``sglang/srt/utils/common.py``,
``sglang/srt/weight_sync/tensor_bucket.py``) rather than imported: ``import sglang.srt.utils`` pulls SGLang's
server (torchvision, PIL, IPython, pydantic, aiohttp ...), which neither the CPU CI nor a bare GPU machine has.
``pybase64`` is the wheel's own base64 codec; where it is not installed the standard ``base64`` (same calls,
same bytes) stands in.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path


def sglang_wire() -> types.SimpleNamespace:
    """``MultiprocessingSerializer``, ``init_custom_process_group``, ``FlattenedTensorBucket`` and
    ``FlattenedTensorMetadata`` of the installed sglang wheel."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise ModuleNotFoundError("the sglang wheel is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    bucket_spec = importlib.util.spec_from_file_location("sglang_tensor_bucket",
                                                        root / "srt" / "weight_sync" / "tensor_bucket.py")
    bucket = importlib.util.module_from_spec(bucket_spec)
    sys.modules[bucket_spec.name] = bucket  # dataclasses look their module up
    bucket_spec.loader.exec_module(bucket)
    common = root / "srt" / "utils" / "common.py"
    wanted = {"MultiprocessingSerializer", "SafeUnpickler"}
    nodes = [n for n in ast.parse(common.read_text()).body if isinstance(n, ast.ClassDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise LookupError(f"{common} lacks {wanted - {n.name for n in nodes}}")
    try:
        import pybase64
    except ModuleNotFoundError:
        import base64 as pybase64
    namespace = {"io": io, "pickle": pickle, "ForkingPickler": ForkingPickler, "pybase64": pybase64,
                 "__name__": "sglang_common"}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(common), "exec"), namespace)
    group_helper = next(n for n in ast.parse(common.read_text()).body
                        if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    import torch

    namespace["torch_release"] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    exec(compile(ast.Module(body=[group_helper], type_ignores=[]), str(common), "exec"), namespace)
    return types.SimpleNamespace(MultiprocessingSerializer=namespace["MultiprocessingSerializer"],
                                 init_custom_process_group=namespace["init_custom_process_group"],
                                 FlattenedTensorBucket=bucket.FlattenedTensorBucket,
                                 FlattenedTensorMetadata=bucket.FlattenedTensorMetadata)


def open_payload(wire: types.SimpleNamespace, payload: str) -> list:
    """One TP rank's payload -> ``[(name, tensor)]``, SGLang's way."""
    data = wire.MultiprocessingSerializer.deserialize(payload)
    metadata = [wire.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                             end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
    return wire.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()


def receive_broadcasts(wire: types.SimpleNamespace, address: str, port: int, bodies: list[dict],
                       device: str = "cpu") -> list[dict]:
    """Join the trainer's weight-update group with SGLang's ``init_custom_process_group`` (rank 1 of 2, as
    ``ModelRunner.init_weights_update_group``), then receive each ``/update_weights_from_distributed`` body's
    flattened bucket as ``ModelRunner._update_bucketed_weights_from_distributed`` does."""
    import datetime

    import torch
    import torch.distributed as dist

    from slimecore.engines.weight_sync import digest

    backend = "nccl" if device == "cuda" else "gloo"
    group = wire.init_custom_process_group(backend=backend, init_method=f"tcp://{address}:{port}", world_size=2,
                                           rank=1, group_name=bodies[0]["group_name"],
                                           timeout=datetime.timedelta(seconds=120))
    out = []
    for body in bodies:
        named = [(name, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                 for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"])]
        bucket = wire.FlattenedTensorBucket(named_tensors=named)
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        out.append({"digests": digest(bucket.reconstruct_tensors()), "devices": [device]})
    return out


def main() -> None:
    import torch.multiprocessing as mp

    from slimecore.engines.weight_sync import digest

    mp.set_sharing_strategy("file_system")  # as the sender's payload names its shared memory
    wire = sglang_wire()
    if sys.argv[1] == "--distributed":  # --distributed ADDRESS PORT DEVICE BODIES.json DIGESTS.json
        address, port, device, bodies, target = sys.argv[2:7]
        result = receive_broadcasts(wire, address, int(port), json.loads(Path(bodies).read_text()), device)
        Path(target).write_text(json.dumps(result))
        # end here: at interpreter exit gloo's threads of the still-joined group may abort the process
        # ("terminate called without an active exception") after the work is done and written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    body = json.loads(Path(sys.argv[1]).read_text())
    assert body["load_format"] == "flattened_bucket", body["load_format"]
    out = []
    for payload in body["serialized_named_tensors"]:
        tensors = open_payload(wire, payload)
        out.append({"digests": digest(tensors), "devices": sorted({t.device.type for _, t in tensors})})
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
