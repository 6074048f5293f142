"""Copies of weight matrices stored transposed, made fast on CPU.

The embedded engine multiplies by such copies where BLAS is faster with them (slot_runner.py) and makes them
anew from every weight update it receives, on the receiving CPUs as the weights arrive: their speed is CPU time
taken beside decoding, and the last weight's copy is added to the update's latency. torch's own copy into a
transposed layout is slow; MKL's out-of-place transpose (`mkl_?omatcopy`, which torch's CPU builds carry) is
several times faster on the same matrices. Where there is no MKL, a copy in the order of the destination's
memory, in panels for large matrices, beats torch's default.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable

import torch

from pipelinerl.engines.embedded.packed import packed_copier, packed_shape

# torch's copy into a transposed matrix: panel by panel from this size up, in panels of this many source rows
# (below ~2 MB one pass was as fast; 64 rows fastest from 1 to 18 MB).
PANEL_MIN_BYTES = 2 << 20
PANEL_ROWS = 64


def transposed_copy(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of the matrix w with the same [rows, cols] values and its memory laid out as w.T's; written into
    `out` (an earlier such copy of a matrix like w) when given, so that steady updates allocate nothing."""
    copy, fill = transposed_copier(w, out)
    fill()
    return copy


def transposed_copier(w: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """`transposed_copy` in two halves: (the copy, not yet filled; a function that fills it with w's values
    as they are when it is called). Made before w's values are there (a receive fills w), so that copying is
    then one call with next to no Python: on the receiving thread, Python holds the GIL that decoding needs."""
    if out is not None and (out.shape, out.dtype, out.device) == (w.shape, w.dtype, w.device) \
            and out.t().is_contiguous():
        memory = out.t()
    else:
        memory = torch.empty(w.shape[::-1], dtype=w.dtype, device=w.device)
    omatcopy = _mkl_omatcopy(w.dtype) if w.device.type == "cpu" and w.is_contiguous() and w.numel() else None
    if omatcopy is None:
        return memory.t(), functools.partial(_copy_transposed, w.detach(), memory)
    rows, cols = w.shape
    args = (b"R", b"T", rows, cols, 1.0, w.data_ptr(), cols, memory.data_ptr(), rows)

    def fill(source: torch.Tensor = w) -> None:  # `source` keeps w's memory alive until the copy
        omatcopy(*args)

    return memory.t(), fill


def relayout_copier(layout: str, w: torch.Tensor, out: torch.Tensor | None = None,
                    shared: bool = False) -> tuple[torch.Tensor, Callable[[], None]]:
    """`transposed_copier` (layout "transposed") or packed.py's `packed_copier` (layout "packed"): a copy of w
    in the layout the runner multiplies that weight by, and the function that fills it. New memory (when `out`
    is not such a copy) is shared memory with `shared`."""
    if layout == "packed":
        if out is None and shared:
            out = torch.empty(packed_shape(*w.shape), dtype=w.dtype, device=w.device).share_memory_()
        return packed_copier(w, out)
    if out is None and shared:
        out = torch.empty(w.shape[::-1], dtype=w.dtype, device=w.device).share_memory_().t()
    return transposed_copier(w, out)


def relayout_copy(layout: str, w: torch.Tensor) -> torch.Tensor:
    """A filled copy of w in `layout` ("transposed" or "packed"), in new ordinary memory."""
    copy, fill = relayout_copier(layout, w)
    fill()
    return copy


def _copy_transposed(src: torch.Tensor, memory: torch.Tensor) -> None:
    """memory (laid out as src.T) = src.T, with torch's copy."""
    src = src.contiguous()
    if src.numel() * src.element_size() < PANEL_MIN_BYTES:
        memory.copy_(src.t())  # in the order of memory's elements: reads strided, writes in sequence
    else:
        for row in range(0, src.shape[0], PANEL_ROWS):  # a panel's columns stay in cache
            memory[:, row:row + PANEL_ROWS].copy_(src[row:row + PANEL_ROWS].t())


@functools.cache
def _mkl_omatcopy(dtype: torch.dtype):
    """MKL's C interface `MKL_Somatcopy` (float32) or `MKL_Domatcopy` (float64) from torch's CPU library, or
    None (another dtype, a build without MKL, or PIPELINERL_MKL_TRANSPOSE=0). ctypes lets go of the GIL
    during the call."""
    name = {torch.float32: ("MKL_Somatcopy", ctypes.c_float), torch.float64: ("MKL_Domatcopy", ctypes.c_double)}
    if dtype not in name or os.environ.get("PIPELINERL_MKL_TRANSPOSE", "1") == "0":
        return None
    symbol, scalar = name[dtype]
    try:
        fn = getattr(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")), symbol)
    except (OSError, AttributeError):
        return None
    fn.restype = None
    size = ctypes.c_size_t
    # ordering, trans, rows, cols, alpha, A, lda, B, ldb
    fn.argtypes = [ctypes.c_char, ctypes.c_char, size, size, scalar, ctypes.c_void_p, size, ctypes.c_void_p, size]
    return fn


class UpdateCopies:
    """Transposed copies of one update's received weights for the runner's relayout slots (slot_runner.py:
    where it multiplies by such copies), built before the switch while decoding goes on with the old weights
    and copies. Built after the switch instead, decoding would run on stale copies (wrong) or on the live
    weights (slower) until they were ready. `received` copies each weight as soon as its last piece has
    arrived, on the receiving thread while the next pieces are in flight (on the process group's own thread):
    a thread of its own would contend with decoding for the GIL at every hand-over. `slots`: every slot the
    update changes; of them, `stale` are changed in place at the switch (a partial update of a fused buffer),
    so their copies can only be built after it. Not `eager`: nothing is built before the switch. `runner`: the
    SlotRunner, or what stands for it in a receiving process (receiving_process.py's CopyBook): `relayout_slots` and
    `copy_plans` are all that is read."""

    def __init__(self, runner, incoming: dict[int, tuple[torch.Tensor | None, list[int]]], eager: bool):
        self.eager = eager
        self.slots: list[int] = []
        self.stale: list[int] = []
        self.copies: dict[int, torch.Tensor] = {}
        self.seconds = 0.0
        self._source: dict[int, torch.Tensor] = {}  # slot -> the received tensor it will hold
        self._missing: dict[int, set[int]] = {}  # slot -> indices of its pieces not yet received
        self._slots_of: dict[int, list[int]] = {}  # piece index -> slots
        for slot, (_, _, live) in enumerate(runner.relayout_slots):
            source, pieces = incoming.get(id(live), (None, []))
            if not pieces:
                continue  # not in this update: the slot keeps its copy
            self.slots.append(slot)
            if source is None:
                self.stale.append(slot)
                continue
            self._source[slot], self._missing[slot] = source, set(pieces)
            for i in pieces:
                self._slots_of.setdefault(i, []).append(slot)
        # the copies' memory and their copying worked out now, so that each copy then is one call
        self._plans = runner.copy_plans(self._source) if eager else {}

    def received(self, indices: list[int]) -> None:
        """Pieces `indices` of the update have arrived: copy the weights now complete (if eager)."""
        if not self.eager:
            return
        for i in indices:
            for slot in self._slots_of.get(i, ()):
                missing = self._missing[slot]
                missing.discard(i)
                if not missing:
                    t0 = time.perf_counter()
                    copy, fill = self._plans[slot]
                    fill()
                    self.copies[slot] = copy
                    self.seconds += time.perf_counter() - t0
