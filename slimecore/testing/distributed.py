"""Run a function on several gloo ranks in spawned processes: for tests that a loss, a trainer or a
collective gives the same result on DP=2 as on one process.

    def per_rank(rank, world, checkpoint):          # module level, so that spawn can import it
        ...                                          # torch.distributed is initialised (gloo)
        return loss, grads.numpy()                   # anything picklable; numpy, not tensors

    results = run_ranks(per_rank, str(checkpoint))   # [rank 0's answer, rank 1's answer]
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any, Callable

from slimecore.engines.router import free_port


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        queue.put((rank, fn(rank, world, *args), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 300) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks; their answers in rank order. A rank that raises
    fails the call with that rank's traceback; a rank that hangs fails it after ``timeout`` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    answers: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, answer, error = queue.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{error}")
            answers[rank] = answer
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.terminate()
    return [answers[r] for r in range(world)]
