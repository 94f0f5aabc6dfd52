"""Test support: run megatron-core 0.16 on a machine without CUDA. Never imported by the product path.

megatron-core calls ``torch.cuda.current_device()`` (175 places), passes ``device="cuda"`` (59), calls ``.cuda()``
(19), makes CUDA streams (the MoE all-to-all dispatcher), synchronises (checkpoint writes), saves CUDA RNG states
(activation recompute) and asserts ``param.grad.type() == "torch.cuda.FloatTensor"`` (clip_grads, the distributed
optimizer); mbridge does the same in its loader and exporter. ``install()`` redirects all of that to the CPU for
the rest of the process, through a ``TorchFunctionMode`` (numbers unchanged: only devices are rewritten), installs
Megatron's own inference RNG tracker, whose ``add``/``fork`` do not touch CUDA, and patches two CPU-only gaps of
megatron-core 0.16.1's MoE code (commented below). The mode is process-wide once entered, so every megatron test
runs in processes of its own (``megatron_checks.py`` through ``run_ranks``; ``cpu_plugin.py`` in train actors;
``shim_cli.py`` for the convert command).

"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _cpu(device):
    """``cuda``, ``cuda:N``, a bare device index or a CUDA ``torch.device`` -> ``"cpu"``; anything else as is."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and str(device).startswith("cuda")):
        return "cpu"
    return device


class _Stream:
    """One stand-in for every CUDA stream and event: work on the CPU is already ordered. Used by the MoE
    all-to-all dispatcher, which copies routing counts to the host on a side stream."""

    _one = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


class CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) else a
                         for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # megatron asserts a CUDA type name; report the CPU tensor as its CUDA twin
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def install() -> None:
    """Enter the CPU mode for the rest of this process (no-op with CUDA or when already installed)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None  # dist_checkpointing before it writes
    CudaToCpu().__enter__()
    # Megatron's inference RNG tracker: ``add``/``fork`` are no-ops instead of CUDA RNG state calls (the backend
    # seeds the CUDA tracker only when CUDA exists; dropout is off, and weights come from the checkpoint).
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Activation recompute saves and restores the CUDA RNG state around the recomputed forward; the CPU has only
    # the torch generator, which the recomputed forward does not draw from (dropout is 0).
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # megatron-core 0.16.1 without Transformer Engine: the MoE router's gating GEMM tests a name that is only
    # defined when TE imports (moe_utils.py:1192, NameError); None selects its plain torch path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The all-to-all dispatcher turns its split sizes into host numpy arrays only for CUDA tensors; CPU tensors
    # stay tensors, which all_to_all_single does not accept as split sizes (expert parallelism > 1).
    from megatron.core.transformer.moe import token_dispatcher

    to_host = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _installed = True
