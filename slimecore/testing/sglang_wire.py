"""Test and benchmark support: SGLang's own receiving end of ``/update_weights_from_tensor``
(``load_format="flattened_bucket"``), run in a process of its own, as an SGLang TP worker opens the trainer's
payload (``tests/test_weight_wire.py``, ``benchmarks/weight_wire.py``).

    python -m slimecore.testing.sglang_wire BODY.json DIGESTS.json

reads the request body, opens each TP rank's payload with the installed ``sglang`` wheel's own
``MultiprocessingSerializer.deserialize`` (and its ``SafeUnpickler``), rebuilds the tensors through its
``FlattenedTensorBucket`` as ``ModelRunner._update_weights_from_flattened_bucket`` does, and writes each
tensor's SHA-256 (``slimecore.engines.weight_sync.digest``) per payload.

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
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path


def sglang_wire() -> types.SimpleNamespace:
    """``MultiprocessingSerializer``, ``FlattenedTensorBucket`` and ``FlattenedTensorMetadata`` of the installed
    sglang wheel."""
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
    return types.SimpleNamespace(MultiprocessingSerializer=namespace["MultiprocessingSerializer"],
                                 FlattenedTensorBucket=bucket.FlattenedTensorBucket,
                                 FlattenedTensorMetadata=bucket.FlattenedTensorMetadata)


def open_payload(wire: types.SimpleNamespace, payload: str) -> list:
    """One TP rank's payload -> ``[(name, tensor)]``, SGLang's way."""
    data = wire.MultiprocessingSerializer.deserialize(payload)
    metadata = [wire.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                             end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
    return wire.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()


def main() -> None:
    import torch.multiprocessing as mp

    from slimecore.engines.weight_sync import digest

    mp.set_sharing_strategy("file_system")  # as the sender's payload names its shared memory
    body = json.loads(Path(sys.argv[1]).read_text())
    wire = sglang_wire()
    assert body["load_format"] == "flattened_bucket", body["load_format"]
    out = []
    for payload in body["serialized_named_tensors"]:
        tensors = open_payload(wire, payload)
        out.append({"digests": digest(tensors), "devices": sorted({t.device.type for _, t in tensors})})
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
