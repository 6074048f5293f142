"""Copies of weight matrices in oneDNN's own blocked layout, in memory that any process can write.

oneDNN multiplies fastest by a weight reordered into the layout its kernel reads (vLLM's CPU build multiplies by
such prepacked weights): on AVX-512 CPUs, faster than by the same weight stored as is or transposed, from a few rows
up, on the shapes of a 0.5B-parameter Qwen2, the more so the larger the weight (docs/benchmarks.md, section "The
engine at 20M, 100M and 494M parameters"). torch hands such weights out only as opaque MKLDNN tensors in memory of
their own, which a weight update could not be received into, nor the receiving process (receiving_process.py) write.
For float32 on AVX-512 CPUs that layout (`AB16b64a`) is plain panels: the weight [out, in] cut into blocks of 64
output rows, each block stored transposed, [out / 64, in, 64]. So the engine keeps such panels as an ordinary dense
tensor (`packed_copier` fills one from a weight in one torch copy) and multiplies by an MKLDNN tensor that views the
same memory (`PackedLayout.view`), made through torch's C shim for ahead-of-time compiled models
(`aoti_torch_create_tensor_from_blob_v2`, which is how those models load prepacked weights). An update writes the
panels; the view sees it.

Everything is checked on the machine before it is used (`PackedLayout.of`): the shim is there, torch's own
reorder of a weight of that shape gives exactly these panels, and a product through the view equals F.linear.
Anything else (another CPU, whose kernel wants another layout; a torch without the shim) leaves the shape
without a packed copy.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Output rows per panel: the 64 of `AB16b64a`; the input dimension must be a multiple of its 16.
PANEL_ROWS = 64
PANEL_IN_MULTIPLE = 16


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    return out_features // PANEL_ROWS, in_features, PANEL_ROWS


def packed_copier(w: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """(panels of w, not yet filled; a function that fills them with w's values as they are when it is called):
    as transpose.py's `transposed_copier`, into `out` (earlier panels of a weight like w) when given. One torch
    copy, which is faster than MKL's transpose of each panel in turn."""
    shape = packed_shape(*w.shape)
    if out is None or (out.shape, out.dtype, out.device) != (shape, w.dtype, w.device) or not out.is_contiguous():
        out = torch.empty(shape, dtype=w.dtype, device=w.device)
    source = w.detach()
    if source.is_contiguous():  # the panels as a view of w, read when the copy runs
        return out, functools.partial(out.copy_, source.view(shape[0], PANEL_ROWS, shape[1]).transpose(1, 2))

    def fill() -> None:
        out.copy_(source.contiguous().view(shape[0], PANEL_ROWS, shape[1]).transpose(1, 2))

    return out, fill


class PackedLayout:
    """How oneDNN reads a weight of one shape from panels (`view`), for a shape where that was checked."""

    def __init__(self, out_features: int, in_features: int, descriptor: bytes):
        self.out_features, self.in_features = out_features, in_features
        self._descriptor = descriptor  # oneDNN's serialized memory descriptor of the blocked weight

    @classmethod
    @functools.cache
    def of(cls, out_features: int, in_features: int) -> PackedLayout | None:
        """The layout of float32 [out, in] weights, or None where packed copies are not usable (see the module
        docstring); worked out once per shape."""
        if out_features % PANEL_ROWS or in_features % PANEL_IN_MULTIPLE or _shim() is None:
            return None
        if os.environ.get("PIPELINERL_PACKED_WEIGHTS", "1") == "0" or not torch.backends.mkldnn.is_available():
            return None
        try:
            g = torch.Generator().manual_seed(0)
            w = torch.empty(out_features, in_features).uniform_(-1, 1, generator=g)
            reordered = torch.ops.mkldnn._reorder_linear_weight(w, 32)  # the layout oneDNN wants for 32 rows
            nbytes = torch.ops.mkldnn._nbytes(reordered)
            panels, fill = packed_copier(w)
            fill()
            if nbytes != panels.numel() * panels.element_size():
                return None
            memory = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(reordered))
            if not torch.equal(torch.frombuffer(memory, dtype=torch.float32), panels.view(-1)):
                return None  # this CPU's kernel wants another blocking
            descriptor = torch.ops.mkldnn._get_mkldnn_serialized_md(reordered).numpy().tobytes()
            layout = cls(out_features, in_features, descriptor)
            x = torch.randn(3, in_features, generator=g)
            b = torch.randn(out_features, generator=g)
            if not torch.allclose(linear_packed(x, layout.view(panels), b), F.linear(x, w, b), atol=1e-4, rtol=1e-4):
                return None
            return layout
        except (RuntimeError, AttributeError, TypeError, OSError):
            return None

    def view(self, panels: torch.Tensor, rows: object = None) -> torch.Tensor:
        """An MKLDNN tensor [out, in] over the memory of `panels` (which it keeps alive, as `.panels`), for
        `linear_packed`; `.rows` is what the runner multiplies by instead for some row counts (slot_runner.py's
        `_RowsOperand`)."""
        shim = _shim()
        sizes = (ctypes.c_int64 * 2)(self.out_features, self.in_features)
        strides = (ctypes.c_int64 * 2)(self.in_features, 1)
        handle = ctypes.c_void_p()
        status = shim.create(panels.data_ptr(), 2, sizes, strides, 0, shim.float32, shim.cpu, 0, ctypes.byref(handle),
                             shim.mkldnn, self._descriptor, len(self._descriptor))
        if status != 0:
            raise RuntimeError(f"aoti_torch_create_tensor_from_blob_v2 failed ({status})")
        view = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(shim.capsule(handle.value, None, None))
        view.panels, view.rows = panels, rows  # the view does not own the memory: keep it alive beside it
        return view


def linear_packed(x: torch.Tensor, view: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(x, view, b, "none", [], "")


class _Shim:
    def __init__(self, lib: ctypes.CDLL):
        self.create = lib.aoti_torch_create_tensor_from_blob_v2
        i64p = ctypes.POINTER(ctypes.c_int64)
        # data, ndim, sizes, strides, storage offset, dtype, device type, device index, out handle, layout,
        # opaque metadata, its size
        self.create.argtypes = [ctypes.c_void_p, ctypes.c_int64, i64p, i64p, ctypes.c_int64, ctypes.c_int32,
                                ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                                ctypes.c_char_p, ctypes.c_int64]
        self.create.restype = ctypes.c_int32
        codes = {}
        for name in ("aoti_torch_dtype_float32", "aoti_torch_device_type_cpu", "aoti_torch_layout__mkldnn"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int32
            codes[name] = fn()
        self.float32 = codes["aoti_torch_dtype_float32"]
        self.cpu = codes["aoti_torch_device_type_cpu"]
        self.mkldnn = codes["aoti_torch_layout__mkldnn"]
        self.capsule = ctypes.pythonapi.PyCapsule_New
        self.capsule.restype = ctypes.py_object
        self.capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


@functools.cache
def _shim() -> _Shim | None:
    """torch's C shim functions for making a tensor over given memory, or None where this torch lacks them."""
    if not hasattr(torch._C, "_aoti") or not hasattr(torch._C._aoti, "alloc_tensor_by_stealing_from_void_ptr"):
        return None
    try:
        return _Shim(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")))
    except (OSError, AttributeError):
        return None
