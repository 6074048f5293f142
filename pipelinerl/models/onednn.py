"""oneDNN's float32 linear product, which torch ships beside its BLAS, and whether it works here.

Both the embedded engine (engines/embedded/linear_kernels.py) and the trainer (trainer/linear_kernels.py) time it
against torch's BLAS per weight shape and use it where it is faster: MKL, torch's BLAS on x86, runs AVX2 code on
AMD CPUs, where oneDNN has AVX-512 kernels (measured: docs/benchmarks.md, "The trainer's matmuls through oneDNN").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` by oneDNN: x @ w.T (+ b). Either operand may be a transposed view (oneDNN reads its
    strides)."""
    return torch.ops.mkldnn._linear_pointwise.default(x, w, b, "none", [], "")


def onednn_works(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linears on this device and dtype: float32 on the CPU, where this torch has oneDNN and one product
    equals F.linear's."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.arange(48.0).view(3, 16) / 47, torch.arange(128.0).view(8, 16).cos(), torch.arange(8.0)
        return torch.allclose(onednn_linear(x, w, b), F.linear(x, w, b), atol=1e-5)
    except (RuntimeError, AttributeError):
        return False
