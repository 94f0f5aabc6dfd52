"""The embedded engine's weights: loading them in place (SGLang's disk, tensor and distributed update endpoints),
their checksums (``/weights_checker``), and releasing and resuming their memory.

Weights: a generation wave holds ``_weights_lock``; every weight update (``load_weights`` underneath the
object-store, disk, tensor and distributed paths) takes it too, so they wait for the running requests (none run while
paused) and the requests queued meanwhile start on the new weights.

:class:`Weights` is the part of :class:`~slimecore.engines.embedded.server.EmbeddedServer` that owns
``_weights_lock``, ``_update_waiting`` (the scheduler stops joining requests while it is set), the weight-update
groups, the released memory tags and ``weight_version``.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from slimecore.engines.http import BadRequest


def _own_weights(model: torch.nn.Module) -> None:
    """Give every CPU parameter memory of its own. transformers maps the safetensors file and loads weights of
    the file's dtype as copy-on-write views of it, so the first weight update (the one before the first
    rollout) would copy each 4 KiB page on a fault: 0.6 s for SmolLM2-135M on a 2-core machine, against 0.17 s
    for one copy here, made while the trainer still loads."""
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()


class Weights:
    """Weight updates, checksums, memory release and resume."""

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     weight_version: str, complete: bool = True) -> str:
        """Copy weights in place; returns the new weight version. ``complete``: every weight must be given
        (the object-store and disk transports); otherwise a bucket of some of them (tensor, distributed).
        Names and shapes must match the model's; tied ``lm_head.weight`` may be left out.

        Waits for the running decode wave (a wave holds the weights lock); requests that join meanwhile
        wait for the new weights."""
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if "weights" in self._released:
            raise BadRequest("the weights are released (/release_memory_occupation); resume them first")
        state = self.model.state_dict()
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [k for k in state if k not in tensors and not (tied and k == "lm_head.weight")] if complete else []
        unexpected = [k for k in tensors if k not in state]
        if missing or unexpected:
            raise BadRequest(f"weights do not match the engine's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise BadRequest(f"weight {name}: shape {tuple(tensor.shape)}, "
                                 f"the model has {tuple(state[name].shape)}")
        self._update_waiting.set()
        try:
            with self._weights_lock, torch.no_grad():
                for name, tensor in tensors.items():
                    state[name].copy_(tensor)
                if self.fast is not None:
                    self.fast.stale = True  # its packed weights are made again at the next step
                self._weights_missing -= set(tensors)
                if tied:
                    self._weights_missing.discard("lm_head.weight")
                self.weight_version = str(weight_version)
        finally:
            self._update_waiting.clear()
        return self.weight_version

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load an HF safetensors directory (same architecture) in place, as /update_weights_from_disk."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return self.load_weights(tensors, weight_version if weight_version is not None else self.weight_version)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                   weight_version: str | None = None) -> str:
        """/update_weights_from_tensor: this engine has one TP rank, so it takes entry 0."""
        from slimecore.engines import weight_sync

        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise BadRequest("serialized_named_tensors must be a non-empty list (one payload per TP rank)")
        try:
            payload = weight_sync.deserialize(serialized_named_tensors[0])
        except (ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise BadRequest(f"serialized_named_tensors[0] is not a tensor payload: {exc}") from None
        if load_format == "flattened_bucket":
            named = weight_sync.unflatten(payload["flattened_tensor"], payload["metadata"])
            if payload["flattened_tensor"].device.type == "cpu":
                # keep the sender's shared memory mapped: it sends the same buffer every sync, which then
                # unpickles from torch's shared-storage cache (no new mapping, no page faults)
                self._mapped_bucket = payload["flattened_tensor"].untyped_storage()
        elif load_format in (None, "direct"):
            named = list(payload)
        else:
            raise BadRequest(f"load_format {load_format!r}: the embedded engine takes null, direct or flattened_bucket")
        return self.load_weights(named, self._next_version(weight_version), complete=False)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """/init_weights_update_group: join the sender's group as rank ``rank_offset`` (blocks until every
        member has joined, as in SGLang)."""
        from slimecore.engines import weight_sync

        if group_name in self._weight_groups:
            raise BadRequest(f"weight-update group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend nccl needs CUDA; the embedded CPU engine joins gloo groups")
        self._weight_groups[group_name] = weight_sync.init_weight_group(
            backend, master_address, master_port, rank_offset, world_size, group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", load_format: str | None = None,
                                        weight_version: str | None = None) -> str:
        """/update_weights_from_distributed: receive the broadcast from rank 0 of the group, then load."""
        from slimecore.engines import weight_sync

        group = self._weight_groups.get(group_name)
        if group is None:
            raise BadRequest(f"Group {group_name} not in {sorted(self._weight_groups)}. "
                             "Please call `init_weights_update_group` first.")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must have the same length")
        try:
            metadata = weight_sync.layout(names, dtypes, shapes)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if load_format == "flattened_bucket":
            flat = torch.empty(metadata[-1].end_idx if metadata else 0, dtype=torch.uint8)
            weight_sync.broadcast(group, flat)
            named = weight_sync.unflatten(flat, metadata)
        elif load_format is None:
            named = [(m.name, torch.empty(m.shape, dtype=m.dtype)) for m in metadata]
            for _, tensor in named:
                weight_sync.broadcast(group, tensor)
        else:
            raise BadRequest(f"load_format {load_format!r}: use null or flattened_bucket")
        return self.load_weights(named, self._next_version(weight_version), complete=False)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if self._weight_groups.pop(group_name, None) is None:
            raise BadRequest("The group to be destroyed does not exist.")

    def weights_digest(self) -> dict[str, str]:
        """``weight_sync.digest`` of the served weights (slime's ``--check-weight-update-equal`` idea)."""
        from slimecore.engines import weight_sync

        with self._weights_lock:
            return weight_sync.digest(self.model.state_dict().items())

    def check_weights(self, action: str = "checksum") -> dict:
        """SGLang's ``/weights_checker`` with action ``checksum``: SGLang's body with every weight's checksum
        (``slimecore.weight_check``), taken under the weights lock (no update runs meanwhile)."""
        from slimecore import weight_check

        if action != "checksum":
            raise BadRequest(f"Unsupported action={action!r}; the embedded engine answers action 'checksum'")
        if "weights" in self._released:
            raise BadRequest("the weights are released (/release_memory_occupation); resume them first")
        with self._weights_lock:
            # a tied lm_head.weight under its own name too: a trainer may send it (an untied copy of the tie)
            named = [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers()]
            return weight_check.checker_response([weight_check.checksum_info(named)])

    def _next_version(self, weight_version: str | None) -> str:
        return self.weight_version if weight_version is None else str(weight_version)

    MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the tagged memory. ``weights``: every parameter goes to the meta device (the memory is
        returned); the non-persistent buffers (rotary tables) are kept aside, they are not weights.
        ``kv_cache`` / ``cuda_graph``: this engine keeps no KV pool between waves and has no graphs, so
        there is nothing to free. Needs an idle engine, as SGLang asserts."""
        tags = self._tags(tags)
        load = self.loads()
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            raise BadRequest("release_memory_occupation needs an idle engine; pause generation first")
        if "weights" in tags and "weights" not in self._released:
            with self._weights_lock:
                saved = set(self.model.state_dict())
                self._buffers = {name: b.clone() for name, b in self.model.named_buffers() if name not in saved}
                self.model.to("meta")
                if self.fast is not None:  # its fused tensors are the weights' storage: let them go too
                    self.fast.release()
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocate the tagged memory again. Resumed weights are uninitialised until a weight update has
        written every one of them; until then /generate answers 400 (SGLang would generate garbage)."""
        tags = self._tags(tags)
        if "weights" in tags and "weights" in self._released:
            with self._weights_lock:
                self.model.to_empty(device="cpu")
                for name, value in self._buffers.items():
                    module, _, attr = name.rpartition(".")
                    self.model.get_submodule(module).register_buffer(attr, value, persistent=False)
                self._buffers = {}
                if self.fast is not None:  # to_empty made new parameters: fuse them again
                    self.fast.bind()
                self._weights_missing = set(self.model.state_dict())
        self._released -= set(tags)

    def _tags(self, tags: list[str] | None) -> list[str]:
        if not tags:
            return list(self.MEMORY_TAGS)
        unknown = [t for t in tags if t not in self.MEMORY_TAGS]
        if unknown:
            raise BadRequest(f"unknown memory tags {unknown}; SGLang's are {list(self.MEMORY_TAGS)}")
        return list(tags)

    def generation_blocker(self) -> str | None:
        """Why /generate cannot run now (weights released or not fully reloaded), or None."""
        if "weights" in self._released:
            return "the engine's weights are released (/release_memory_occupation); resume them first"
        if self._weights_missing:
            return (f"{len(self._weights_missing)} weights are not loaded since /resume_memory_occupation "
                    "(e.g. " + sorted(self._weights_missing)[0] + "); push the weights first")
        return None

    def memory_usage(self) -> dict:
        """SGLang's ``memory_usage`` (GB): the bytes the weights hold now (0 while released); this engine
        keeps no KV pool between waves and no graphs."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (self.model.state_dict().values() if self.ready else ()) if not t.is_meta}
        return {"weight": sum(storages.values()) / 1024**3, "kvcache": 0.0, "graph": 0.0}
