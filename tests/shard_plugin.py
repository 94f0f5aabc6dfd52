"""Test plugin: the fsdp backend shards its ranks' weights (FSDP2 ``fully_shard``) on CPU too, as it does by
default on CUDA with more than one rank, so a CPU run exercises the collective weight export (every rank must
take part in gathering the weights train rank 0 pushes). ``--hang-push N``: train rank 1 hangs in its Nth
weight push, as a rank stuck outside the gather would (rank 0 then waits in it)."""

from __future__ import annotations

import itertools
import time

from slimecore import hookimpl
from slimecore.config import Option


@hookimpl
def slime_options():
    return [Option("hang_push", int, 0, "Train rank 1 hangs in its Nth weight push (0: never).")]


@hookimpl
def slime_startup(config, process):
    if process != "train":
        return
    from slimecore.trainers import fsdp

    build, export = fsdp.FSDPBackend.__init__, fsdp.FSDPBackend.hf_weight_buckets
    pushes, hang_at = itertools.count(1), config.plugin("shard_plugin").hang_push

    def sharded(self, *args, shard=None, **kwargs):
        build(self, *args, shard=True, **kwargs)

    def buckets(self, bucket_bytes):
        if self.rank == 1 and next(pushes) == hang_at:
            time.sleep(3600)
        return export(self, bucket_bytes)

    fsdp.FSDPBackend.__init__ = sharded
    fsdp.FSDPBackend.hf_weight_buckets = buckets
