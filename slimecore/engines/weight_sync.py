"""SGLang's weight-sync wire formats, shared by the sender (train rank 0) and the embedded engine.

Three ways new weights reach an engine, each an SGLang endpoint (bodies: :func:`tensor_body`,
:func:`init_group_body`, :func:`distributed_body`, :func:`disk_body`; the tests check every key against
SGLang's own request classes):

- ``/update_weights_from_tensor``: a *flattened bucket* (one uint8 tensor holding the bucket's tensors
  back to back, widest dtype first (:func:`wire_order`), plus per-tensor metadata) pickled with torch's multiprocessing reductions and base64
  encoded, as SGLang's ``MultiprocessingSerializer`` does. A CUDA tensor travels as a CUDA IPC handle; a
  CPU tensor as a shared-memory file name (torch's ``file_system`` sharing strategy: the receiver is
  not a child of the sender, so the default fd-passing strategy cannot work). Same host only.
- ``/init_weights_update_group`` once, then per bucket ``/update_weights_from_distributed`` (names,
  dtypes, shapes) while the sender broadcasts the flattened bucket from rank 0 of that group (NCCL on
  GPU, gloo on CPU). Works across hosts.
- ``/update_weights_from_disk``: an HF safetensors directory.

The metadata entries are ``types.SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)``:
SGLang's loader reads exactly those attributes, and the type is on both sides' unpickling allow-lists.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import pickle
import types
from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # slime's --update-weight-buffer-size default
DEFAULT_GROUP = "slimecore-weights"

NamedTensors = list[tuple[str, torch.Tensor]]


# -- buckets -------------------------------------------------------------------------------------
def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket of its own)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor once: a name whose tensor is the same memory as an earlier one (tied embeddings:
    ``lm_head.weight`` is ``embed_tokens.weight``) is left out, as SGLang's loaders skip it anyway."""
    seen = set()
    for name, tensor in named:
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if key not in seen:
            seen.add(key)
            yield name, tensor


def wire_order(named: NamedTensors) -> NamedTensors:
    """The bucket's tensors grouped by dtype, the widest element first (dtypes of one width in the order first
    seen), as they go on the wire. SGLang's ``FlattenedTensorBucket`` packs tensors back to back and its
    ``reconstruct_tensors`` views each byte span as its dtype, which torch allows only at an offset that is a
    multiple of the element size: an odd-length bf16 tensor before an fp32 one fails inside SGLang's own
    class. Element sizes being powers of two, every span starts aligned in this order with nothing between
    them, so the layout is the one ``FlattenedTensorBucket(named_tensors=...)`` builds from the same list,
    which SGLang's distributed receiver does from ``/update_weights_from_distributed``'s names."""
    first: dict[torch.dtype, int] = {}
    for _, tensor in named:
        first.setdefault(tensor.dtype, len(first))
    return sorted(named, key=lambda item: (-item[1].element_size(), first[item[1].dtype]))


def flatten(named: NamedTensors, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 tensor (on the tensors' device) holding every tensor's bytes back to back in
    :func:`wire_order`, and its metadata (in that order). ``out``: a uint8 buffer to fill (its leading bytes;
    e.g. a reused shared-memory buffer)."""
    named = wire_order(named)
    device = named[0][1].device
    metadata, start = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start,
                                              end_idx=start + nbytes, numel=nbytes))
        start += nbytes
    flat = torch.empty(start, dtype=torch.uint8, device=device) if out is None else out[:start]
    for meta, (_, tensor) in zip(metadata, named):
        flat[meta.start_idx:meta.end_idx].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    return flat, metadata


def shared_span(named: NamedTensors) -> tuple[torch.Tensor, list[types.SimpleNamespace]] | None:
    """When every tensor is a contiguous view of one shared-memory CPU storage, in increasing order without
    overlap (the weights :func:`share_weights` placed): the uint8 span of that storage from the first
    tensor's start to the last one's end, and metadata giving each tensor's place in it (alignment gaps
    between tensors are skipped by the offsets, as SGLang's loader reads them). Else None."""
    first = named[0][1]
    if first.device.type != "cpu" or not first.untyped_storage().is_shared():
        return None
    storage = first.untyped_storage()
    base = end = first.storage_offset() * first.element_size()
    metadata = []
    for name, tensor in named:
        start = tensor.storage_offset() * tensor.element_size()
        if tensor.untyped_storage().data_ptr() != storage.data_ptr() or not tensor.is_contiguous() or start < end:
            return None
        end = start + tensor.numel() * tensor.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                              start_idx=start - base, end_idx=end - base, numel=end - start))
    return torch.empty(0, dtype=torch.uint8).set_(storage, base, (end - base,)), metadata


def share_weights(module: torch.nn.Module, align: int = 64) -> int:
    """Move ``module``'s state-dict tensors (each storage once, in ``state_dict`` order) into one buffer in
    shared memory, each becoming a view of it; returns the buffer's bytes. The module trains as before
    (in-place updates write the buffer); a tensor-transport push of these weights then sends spans of
    the buffer itself (:func:`shared_span`), so the engine's copy into its own parameters is the only copy
    of a sync. CPU only (a CUDA bucket travels as an IPC handle anyway); call it before an optimizer
    holds state for the tensors. Each tensor starts on an ``align``-byte boundary."""
    named = list(unique_tensors(module.state_dict(keep_vars=True).items()))
    if not named or any(t.device.type != "cpu" for _, t in named):
        raise ValueError("share_weights needs a module whose weights are all on the CPU")
    offsets, size = [], 0
    for _, tensor in named:
        size = -(-size // align) * align
        offsets.append(size)
        size += tensor.numel() * tensor.element_size()
    flat = torch.empty(size, dtype=torch.uint8)
    with file_system_sharing():
        flat.share_memory_()
    with torch.no_grad():
        for (_, tensor), start in zip(named, offsets):
            view = flat[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            tensor.data = view
    return size


def shared_file(tensor: torch.Tensor) -> str:
    """The ``/dev/shm`` file behind a CPU tensor in shared memory under the file-system strategy
    (:func:`share_weights`). torch's shm manager unlinks such a file when its processes end normally; Ray
    ends an actor's whole process group, manager included, so the process that ends the actors unlinks it
    (the mappings stay valid until unmapped)."""
    with file_system_sharing():
        _, name, _ = tensor.untyped_storage()._share_filename_cpu_()
    return "/dev/shm" + (name.decode() if isinstance(name, bytes) else name)


def unflatten(flat: torch.Tensor, metadata: Iterable) -> NamedTensors:
    """Views of ``flat`` per metadata entry (SGLang's ``FlattenedTensorBucket.reconstruct_tensors``)."""
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[types.SimpleNamespace]:
    """Metadata of a flattened bucket described by ``/update_weights_from_distributed``'s fields (back to back
    in the order given, as SGLang's ``FlattenedTensorBucket`` lays them out)."""
    metadata, start = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = dtype_from_name(dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=torch_dtype).element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=torch_dtype, start_idx=start,
                                              end_idx=start + nbytes, numel=nbytes))
        start += nbytes
    return metadata


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """SHA-256 of every tensor's bytes: equal digests mean bit-for-bit equal weights (and dtypes, shapes)."""
    import hashlib

    out = {}
    for name, tensor in named:
        data = tensor.detach().to("cpu").contiguous()
        out[name] = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode()
                                   + data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


# -- MultiprocessingSerializer's format ------------------------------------------------------------
@contextlib.contextmanager
def file_system_sharing():
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def serialize(obj) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: a base64 ``ForkingPickler`` pickle."""
    from multiprocessing.reduction import ForkingPickler

    buffer = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


class _AllowListUnpickler(pickle.Unpickler):
    """Only the globals a tensor payload needs (SGLang's receiver has the same kind of allow-list)."""

    ALLOWED_PREFIXES = ("torch.", "collections.OrderedDict", "copyreg._reconstructor", "types.SimpleNamespace",
                        "builtins.getattr", "builtins.tuple", "builtins.list", "builtins.dict", "builtins.int",
                        "builtins.object")

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if not full.startswith(self.ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"weight payload refers to {full}, which is not allowed")
        return super().find_class(module, name)


def deserialize(payload: str):
    """The inverse of :func:`serialize`; rejects pickles that name anything but tensor machinery."""
    data = base64.b64decode(payload, validate=True)
    return _AllowListUnpickler(io.BytesIO(data)).load()


# -- a weight-update process group -----------------------------------------------------------------
def init_weight_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout: float = 600):
    """A process group of its own (not the default one: the trainer already has a training group), as
    SGLang's ``init_custom_process_group``: rank 0 is the sender and hosts the rendezvous store. The store's
    keys are laid out as that helper lays them out (``PrefixStore(group_name)``, then torch's
    ``_new_process_group_helper`` adds ``"{group_name}/"`` and ``"{device}/"``), so the other ranks may be real
    SGLang engines (``tests/test_weight_wire.py`` joins with SGLang's own helper)."""
    import torch.distributed as dist

    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=delta)
    device = "cuda" if backend == "nccl" else "cpu"
    store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, delta)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-update group backend {backend!r}: use gloo (CPU) or nccl (GPU)")


def broadcast(group, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 of ``group`` (in place on the other ranks)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


# -- request bodies (SGLang's field names) -----------------------------------------------------------
def tensor_body(payloads: list[str], weight_version: str) -> dict:
    """``UpdateWeightsFromTensorReqInput``: one payload per TP rank of the engine (each rank loads the full
    tensors and keeps its shard; each payload is a serialisation of its own, as each rank opens it once),
    flattened-bucket format, cache flushed by the caller."""
    return {"serialized_named_tensors": list(payloads), "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": weight_version}


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str) -> dict:
    """``InitWeightsUpdateGroupReqInput``."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def distributed_body(named: NamedTensors, group_name: str, weight_version: str) -> dict:
    """``UpdateWeightsFromDistributedReqInput`` for one flattened bucket broadcast right after it (the tensors
    in :func:`wire_order`, as :func:`flatten` packs them)."""
    named = wire_order(named)
    return {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name, "flush_cache": False,
            "weight_version": weight_version, "load_format": "flattened_bucket"}


def disk_body(path: str, weight_version: str) -> dict:
    """``UpdateWeightFromDiskReqInput``."""
    return {"model_path": path, "weight_version": weight_version}
