"""Train rank 0 pushes its weights straight to the engines over SGLang's weight endpoints.

Two transports (the driver picks one, ``slimecore.weight_updates``); the engines are paused and their
cache flushed by the rollout manager before, and resumed after:

- ``tensor`` (trainer and engines on one host): per bucket, one flattened tensor in shared memory
  (CPU) or device memory (CUDA IPC), serialised once and posted to every engine's
  ``/update_weights_from_tensor``. The bucket stays alive until every engine has answered, because an
  engine reads it in place. On CPU the fsdp trainer keeps its weights in shared memory
  (``weight_sync.share_weights``), so a bucket is a span of them and the engine's copy into its own
  parameters is the only copy; other weights (LoRA-merged, gathered, megatron's) are first copied into
  one shared buffer kept across syncs.
- ``distributed``: ``/init_weights_update_group`` on every engine and a rendezvous as rank 0 of a group
  of ``1 + sum(engine TP sizes)`` ranks (gloo on CPU, NCCL on GPU), once per engine set; per bucket,
  ``/update_weights_from_distributed`` on every engine while rank 0 broadcasts the flattened bucket
  (the engines' calls return once they have it). A changed engine set (an engine restarted on a new
  port) gets a new group on the next push.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from slimecore import weight_check
from slimecore.engines import weight_sync
from slimecore.engines.launch import Endpoint
from slimecore.engines.router import free_port, http_json

log = logging.getLogger("slimecore.weights")


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update; the message names the engine and the endpoint."""


class EngineUnreachable(WeightSyncError):
    """An engine could not be reached at all (it died); with fault tolerance the push goes on without it."""


class WeightSender:
    def __init__(self, bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES, timeout: float = 600,
                 master_address: str | None = None, skip_unreachable: bool = False):
        self.bucket_bytes, self.timeout = bucket_bytes, timeout
        self.skip_unreachable = skip_unreachable
        self.master_address = master_address
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weight-post")
        self._shared: torch.Tensor | None = None
        self._group = None
        self._group_name: str | None = None
        self._group_members: tuple[Endpoint, ...] = ()
        self._groups_made = 0
        self._checksum: str | None = None  # push's ``checksum`` while it runs
        self._checksums: dict[str, str] = {}

    # -- HTTP ------------------------------------------------------------------------------------
    def _post(self, endpoint: Endpoint, path: str, body: dict) -> dict:
        try:
            status, answer = http_json("POST", endpoint.url + path, body, timeout=self.timeout,
                                       api_key=endpoint.api_key)
        except OSError as exc:
            raise EngineUnreachable(f"POST {endpoint.url}{path} failed: {getattr(exc, 'reason', exc)}") from None
        if status >= 300 or (isinstance(answer, dict) and answer.get("success") is False):
            raise WeightSyncError(f"POST {endpoint.url}{path} -> HTTP {status}: {str(answer)[:500]}")
        return answer

    def _post_all(self, endpoints: Iterable[Endpoint], path: str, bodies: Iterable[dict]) -> list[Future]:
        return [self._pool.submit(self._post, e, path, b) for e, b in zip(endpoints, bodies)]

    def _wait(self, futures: list[Future]) -> None:
        errors = [f.exception() for f in futures if f.exception() is not None]  # waits for every one
        if self.skip_unreachable:  # an engine that died mid-push is the health monitor's to restart
            for error in [e for e in errors if isinstance(e, EngineUnreachable)]:
                log.warning("weight push skipped an unreachable engine (the fault monitor restarts it): %s", error)
            errors = [e for e in errors if not isinstance(e, EngineUnreachable)]
        if errors:
            raise errors[0]

    # -- pushes ----------------------------------------------------------------------------------
    def push(self, buckets: Iterable[weight_sync.NamedTensors], endpoints: list[Endpoint], version: str,
             transport: str, checksum: str | None = None) -> dict:
        """Send every bucket to every engine; returns ``{"seconds", "bytes", "buckets"}``, and with ``checksum``
        (``"all"``, or ``"1d"``: the tensors an SGLang engine keeps under their HF name) ``"checksums"``: the
        ``slimecore.weight_check`` checksum of every tensor sent, computed while the engines load the bucket."""
        start, total, count = time.perf_counter(), 0, 0
        self._checksum, self._checksums = checksum, {}
        if transport == "distributed":
            self._connect(endpoints)
        for bucket in buckets:
            if transport == "tensor":
                total += self._send_tensor(bucket, endpoints, str(version))
            elif transport == "distributed":
                total += self._send_distributed(bucket, endpoints, str(version))
            else:
                raise ValueError(f"transport {transport!r}: the sender does tensor or distributed")
            count += 1
        figures = {"seconds": time.perf_counter() - start, "bytes": float(total), "buckets": float(count)}
        if checksum is not None:
            figures["checksums"] = self._checksums
        return figures

    def _sum_while_loading(self, bucket: weight_sync.NamedTensors) -> None:
        """The bucket's checksums, taken while the engines copy it (the hash releases the GIL; this thread
        would otherwise only wait for their answers)."""
        if self._checksum is not None:
            self._checksums.update(weight_check.checksums(bucket, only_1d=self._checksum == "1d"))

    def _send_tensor(self, bucket: weight_sync.NamedTensors, endpoints: list[Endpoint], version: str) -> int:
        cpu = bucket[0][1].device.type == "cpu"
        # weights the trainer keeps in shared memory (weight_sync.share_weights) go as they lie, without a copy
        flat, metadata = weight_sync.shared_span(bucket) or weight_sync.flatten(
            bucket, out=self._shared_buffer(bucket) if cpu else None)
        # one payload per engine TP rank: serialising takes one reference to the shared memory and the rank that
        # opens it gives one back, so a payload shared by several ranks would give back more than it took and
        # unlink the kept buffer's file (a later engine, one restarted after a fault, could not open it)
        futures = self._post_all(endpoints, "/update_weights_from_tensor",
                                 [weight_sync.tensor_body([weight_sync.serialize({"flattened_tensor": flat,
                                                                                  "metadata": metadata})
                                                           for _ in range(e.tp_size)], version) for e in endpoints])
        self._sum_while_loading(bucket)
        self._wait(futures)
        if not cpu:  # a CUDA bucket is never reused (SGLang may still be copying from it), only freed
            del flat
            torch.cuda.ipc_collect()
        return int(metadata[-1].end_idx)

    def _shared_buffer(self, bucket: weight_sync.NamedTensors) -> torch.Tensor:
        """One shared-memory buffer kept across buckets and syncs: its pages stay mapped, so only the first
        sync pays for faulting them in. Reusing it is safe on CPU: an engine answers after it has copied."""
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if self._shared is None or self._shared.numel() < nbytes:
            self._shared = None
            self._shared = torch.empty(nbytes, dtype=torch.uint8)
            with weight_sync.file_system_sharing():
                self._shared.share_memory_()
        return self._shared

    def shared_files(self) -> list[str]:
        """The ``/dev/shm`` file of the kept buffer, once a push made it."""
        return [] if self._shared is None else [weight_sync.shared_file(self._shared)]

    def _send_distributed(self, bucket: weight_sync.NamedTensors, endpoints: list[Endpoint], version: str) -> int:
        flat, _ = weight_sync.flatten(bucket)
        body = weight_sync.distributed_body(bucket, self._group_name, version)
        futures = self._post_all(endpoints, "/update_weights_from_distributed", [body] * len(endpoints))
        weight_sync.broadcast(self._group, flat)
        self._sum_while_loading(bucket)
        self._wait(futures)
        return flat.numel()

    # -- the distributed group ---------------------------------------------------------------------
    def _connect(self, endpoints: list[Endpoint]) -> None:
        if tuple(endpoints) == self._group_members:
            return
        self.close()
        self._groups_made += 1
        name = f"{weight_sync.DEFAULT_GROUP}-{self._groups_made}"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        address = self.master_address or _address_for(endpoints)
        port = free_port()
        offsets, world = [], 1
        for endpoint in endpoints:
            offsets.append(world)
            world += endpoint.tp_size
        futures = self._post_all(endpoints, "/init_weights_update_group",
                                 [weight_sync.init_group_body(address, port, offset, world, name, backend)
                                  for offset in offsets])
        try:
            group = weight_sync.init_weight_group(backend, address, port, 0, world, name, self.timeout)
        except Exception as exc:  # the engines' answers say why they did not join
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception() from exc
            raise
        self._wait(futures)
        self._group, self._group_name, self._group_members = group, name, tuple(endpoints)
        log.info("weight-update group %s: %d engine ranks, %s at %s:%d", name, world - 1, backend, address, port)

    def close(self) -> None:
        """Leave the distributed group; engines that are gone are skipped."""
        if self._group is None:
            return
        for endpoint in self._group_members:
            try:
                self._post(endpoint, "/destroy_weights_update_group", {"group_name": self._group_name})
            except WeightSyncError as exc:
                log.warning("could not destroy the weight group on %s: %s", endpoint.url, exc)
        self._group, self._group_name, self._group_members = None, None, ()


def _address_for(endpoints: list[Endpoint]) -> str:
    """127.0.0.1 when every engine is on loopback, else this node's address (the engines connect to it)."""
    if all(urlparse(e.url).hostname in ("127.0.0.1", "localhost") for e in endpoints):
        return "127.0.0.1"
    import ray.util

    return ray.util.get_node_ip_address()
