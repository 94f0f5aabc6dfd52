"""The devices a test runs on, and its tolerances per device and dtype.

``DEVICES`` parametrises a test over the CPU and, marked ``gpu``, CUDA (skipped by name without it), so that
``pytest -m gpu`` on a GPU machine runs the same checks there. Tolerances:

- CPU fp32: 1e-6, the project's bar (the same kernels run whatever the batching);
- CUDA fp32: TF32 is switched off for these tests (``fp32_strict``), but cuBLAS picks kernels by shape and the
  embedding backward sums with atomics, so a sample's result depends on its neighbours and on the order of the
  sums by rounding: 1e-5;
- bf16 (autocast on either device): 8 mantissa bits, 2e-2 on log-probs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu,
                                                  pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
_TOLERANCE = {("cpu", torch.float32): 1e-6, ("cuda", torch.float32): 1e-5,
              ("cpu", torch.bfloat16): 2e-2, ("cuda", torch.bfloat16): 2e-2}


def tolerance(device: str | torch.device, dtype: torch.dtype = torch.float32) -> float:
    """The largest absolute difference two computations of the same value may show on ``device`` in ``dtype``."""
    return _TOLERANCE[(torch.device(device).type, dtype)]


@contextlib.contextmanager
def fp32_strict():
    """fp32 matmuls and convolutions without TF32 inside the block (CUDA; nothing changes on the CPU)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
