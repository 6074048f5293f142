"""The trainer's float32 linear layers through oneDNN on CPUs where oneDNN multiplies faster than BLAS.

On a CPU, torch multiplies a float32 `nn.Linear` (forward and backward) with its BLAS, MKL in the x86 wheels. MKL
picks its kernels by CPU vendor: on AMD CPUs it runs AVX2 code, where oneDNN, which torch also ships and which picks
kernels by instruction set, runs AVX-512 code and multiplies a training step's products faster (docs/benchmarks.md,
section "The trainer's matmuls through oneDNN"; bench/linear_kernels.py). On Intel CPUs MKL runs its
AVX-512 code and oneDNN may gain nothing (not measured). So `trainer.linear_kernel: auto` times both kernels on the
model's own weight shapes at start-up, on the trainer's threads, and routes through oneDNN only the shapes where it
was faster.

A routed layer keeps its module, parameters, hooks and state dict; only its forward changes, to
`OneDNNLinear`, whose backward makes the same two products as `F.linear`'s (input and weight gradients), also
through oneDNN. Models whose parameters are sharded (ZeRO-3, FSDP) or not float32 on a CPU keep torch's path, and a
routed layer called under autocast (trainer.mixed_precision bf16) takes torch's path for that call.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelinerl.models.onednn import onednn_linear, onednn_works

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "blas", "onednn")
# auto leaves weights smaller than this on BLAS untimed: there the two kernels are within the timing noise of each
# other, so timing them could not choose reliably, and a step's time is elsewhere
AUTO_MIN_ELEMENTS = 8192
# a shape is routed through oneDNN when its forward and backward products took at most this share of BLAS's time:
# a margin wide enough that timing noise does not flip the choice, yet well above the share oneDNN takes where its
# AVX-512 kernels win (docs/benchmarks.md, section "The trainer's matmuls through oneDNN"; bench/linear_kernels.py)
FASTER_BY = 0.8
# rows of the timed products: enough to be a training product, few enough that timing stays well under a second
# for a ~100M model (a product of at most TIMED_MACS multiply-adds, at least TIMED_MIN_ROWS rows)
TIMED_MACS = 1 << 26
TIMED_MIN_ROWS, TIMED_MAX_ROWS = 64, 2048


class OneDNNLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` with the forward and both backward products by oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.has_bias, ctx.input_shape = bias is not None, x.shape
        return onednn_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad_rows, weight.t()).view(ctx.input_shape)  # dy @ W
        if ctx.needs_input_grad[1]:
            grad_w = onednn_linear(grad_rows.t(), rows.t())  # dy^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b


def _onednn_forward(self: nn.Linear, x: Tensor) -> Tensor:
    # a model moved off the CPU after routing (accelerate moves it to the GPU), or mixed precision: torch's path
    if x.device.type != "cpu" or x.dtype != self.weight.dtype or torch.is_autocast_enabled("cpu"):
        return F.linear(x, self.weight, self.bias)
    return OneDNNLinear.apply(x, self.weight, self.bias)


def routable(module: nn.Module) -> bool:
    """A float32 nn.Linear whose weight is a whole, plain tensor on the CPU (not a ZeRO-3 / FSDP shard)."""
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and type(w) is nn.Parameter and w.device.type == "cpu"
            and w.dtype == torch.float32 and w.dim() == 2 and w.numel() > 0)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, after one warm-up call (oneDNN builds and caches its primitive on the
    first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def training_products(x: Tensor, w: Tensor, dy: Tensor) -> list[tuple[str, Callable[[], Tensor], Callable[[], Tensor]]]:
    """(name, BLAS call, oneDNN call) of a training step's three products of the weight w [out, in], for inputs x
    [rows, in] and output gradients dy [rows, out]: the forward, the input gradient and the weight gradient."""
    return [("forward", lambda: F.linear(x, w), lambda: onednn_linear(x, w)),
            ("input_grad", lambda: dy @ w, lambda: onednn_linear(dy, w.t())),
            ("weight_grad", lambda: dy.t() @ x, lambda: onednn_linear(dy.t(), x.t()))]


@torch.no_grad()
def time_shape(out_f: int, in_f: int, repeats: int = 3) -> tuple[float, float]:
    """(BLAS seconds, oneDNN seconds) for one training step's products of a weight [out_f, in_f]
    (`training_products`), each the best of `repeats` calls, on random operands."""
    rows = max(TIMED_MIN_ROWS, min(TIMED_MAX_ROWS, TIMED_MACS // (out_f * in_f)))
    products = training_products(torch.rand(rows, in_f), torch.rand(out_f, in_f), torch.rand(rows, out_f))
    return (sum(best_seconds(blas, repeats) for _, blas, _ in products),
            sum(best_seconds(onednn, repeats) for _, _, onednn in products))


def choose_shapes(model: nn.Module, kernel: str) -> set[tuple[int, int]]:
    """The weight shapes of `model`'s routable linear layers to multiply through oneDNN, by `kernel`: "blas"
    none, "onednn" all, "auto" those of at least AUTO_MIN_ELEMENTS where oneDNN's three products took at most FASTER_BY
    of BLAS's time (timed once per process and thread count)."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"trainer.linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    shapes = {tuple(m.weight.shape) for m in model.modules() if routable(m)}
    if kernel == "blas" or not shapes or not onednn_works(torch.device("cpu"), torch.float32):
        return set()
    if kernel == "onednn":
        return shapes
    return {(o, i) for o, i in shapes if o * i >= AUTO_MIN_ELEMENTS and _onednn_faster(o, i, torch.get_num_threads())}


# {(out, in, threads): oneDNN chosen}: decided once per process, so that every model the process builds (the
# policy, its reference, its critic, a second trainer in a test) multiplies a shape the same way
_decisions: dict[tuple[int, int, int], bool] = {}


def _onednn_faster(out_f: int, in_f: int, threads: int) -> bool:
    key = (out_f, in_f, threads)
    if key not in _decisions:
        blas_s, onednn_s = time_shape(out_f, in_f)
        log.debug("linear %dx%d on %d threads: BLAS %.2f ms, oneDNN %.2f ms", out_f, in_f, threads, blas_s * 1e3,
                  onednn_s * 1e3)
        _decisions[key] = onednn_s <= FASTER_BY * blas_s
    return _decisions[key]


def route_linears(model: nn.Module, shapes: set[tuple[int, int]]) -> int:
    """Make every routable linear layer of `model` with a weight shape in `shapes` multiply through oneDNN
    (`OneDNNLinear`); returns how many. Its parameters, hooks and state dict stay as they are."""
    routed = 0
    for module in model.modules():
        if routable(module) and tuple(module.weight.shape) in shapes:
            module.forward = types.MethodType(_onednn_forward, module)
            routed += 1
    return routed


def is_routed(module: nn.Module) -> bool:
    """Whether `route_linears` routed this layer through oneDNN (the chunked LM head multiplies its weight
    directly, not through the module, and follows the same choice: trainer/forward.py)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _onednn_forward


def unroute_linears(model: nn.Module) -> int:
    """Back to torch's own forward for every layer `route_linears` routed; returns how many."""
    count = 0
    for module in model.modules():
        if is_routed(module):
            del module.forward
            count += 1
    return count
