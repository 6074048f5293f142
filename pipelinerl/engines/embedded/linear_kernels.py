"""How the slot runner multiplies by each weight shape on a CPU, chosen by timing it once at start-up.

Whether each weight shape is multiplied through a copy stored transposed (so that BLAS gets an untransposed
operand; see "weights stored transposed" in slot_runner.py) or packed in oneDNN's blocked layout (packed.py), and
which kernel multiplies it for how many rows (`F.linear`, i.e. BLAS, or oneDNN's `_linear_pointwise`; with a
packed copy, oneDNN on the copy or either kernel on the weight as stored) are timed once when the runner is built
(`LinearKernels.timed`), since the winner depends on the CPU: on AMD CPUs, where torch's BLAS (MKL) runs AVX2 code,
oneDNN beats BLAS from mid-sized products up, and beats it again with packed weights from a few rows up (one row
reads faster from a weight as stored); on Intel CPUs BLAS wins the smaller products (less fixed cost per call) and
the transposed copies win at decode sizes (docs/benchmarks.md, sections "The engine at 20M, 100M and 494M
parameters" and "Embedded engine decode"; bench/engine_scale.py, bench/engine_decode.py).
oneDNN is slow at one row, so a packed weight may keep a transposed copy as well, for single-sequence decoding
(`SECOND_COPY_MIN_GAIN`, `SECOND_COPIES_MAX_BYTES`). PIPELINERL_ONEDNN=0 leaves oneDNN out (`onednn_usable`),
PIPELINERL_PACKED_WEIGHTS=0 the packed copies (`PackedLayout.of`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipelinerl.engines.embedded.packed import PackedLayout, linear_packed
from pipelinerl.engines.embedded.transpose import relayout_copy, transposed_copy
from pipelinerl.models.onednn import onednn_linear as _onednn_linear
from pipelinerl.models.onednn import onednn_works

# LinearKernels times both kernels for row counts 1, 2, 4, ... up to this; more rows use the last decision.
TIMED_MAX_ROWS = 256
# Products of at least this many multiply-adds are not timed and use oneDNN (on the packed copy, where the shape
# has one). Products from TIMED_FEW_MACS up are timed with TIMED_FEW_REPEATS repeats, from TIMED_ONCE_MACS up
# with one (each call takes milliseconds, and a large model has many shapes), and BLAS only for up to
# TIMED_BLAS_MAX_ROWS rows: above that, BLAS has not been seen to beat oneDNN on any shape (nor another layout
# oneDNN's packed one, from 16 rows of 0.1-0.5B-parameter shapes up), yet where the packed layout pays most is on
# large products at many rows, so those are timed.
TIMED_MAX_MACS = 1 << 33
TIMED_FEW_MACS = 1 << 25
TIMED_ONCE_MACS = 1 << 30
TIMED_FEW_REPEATS = 2
TIMED_BLAS_MAX_ROWS = 8
# Timing rotates through copies of each weight, this many bytes of them (at most TIMED_MAX_COPIES copies):
# in a decode step every weight comes from memory, not from a cache it was just read into, and the layouts
# differ most in how fast they stream from memory.
TIMED_COLD_BYTES = 64 << 20
TIMED_MAX_COPIES = 8
# A weight shape gets transposed (or packed) copies when that makes its linears at least this much faster.
TRANSPOSED_MIN_GAIN = 0.05
# A packed shape also keeps transposed copies, for one row (what decoding a single sequence multiplies), when
# those make one row at least this much faster (oneDNN is slow at one row: BLAS on a transposed copy beats it
# there at 20M-parameter shapes), as long as all such second copies fit in SECOND_COPIES_MAX_BYTES.
SECOND_COPY_MIN_GAIN = 0.1
SECOND_COPIES_MAX_BYTES = 1 << 30


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linears on this device and dtype, unless PIPELINERL_ONEDNN=0; checked once against F.linear."""
    return os.environ.get("PIPELINERL_ONEDNN", "1") != "0" and onednn_works(device, dtype)


class LinearKernels:
    """How each weight shape is multiplied: through a copy (transposed, or packed) or not, and by which kernel.

    `self(x, w, b)` = F.linear(x, w, b) for x [rows, in], through the kernel chosen for w's shape and about
    that many rows: BLAS (`F.linear`) or oneDNN (`_onednn_linear`). `use_onednn[(out, in)][bucket]` says which,
    by row bucket (rows.bit_length(), the last bucket also taking every larger row count). `transposed`: the
    shapes whose weights are multiplied stored as w.T (`transposed_copy`): the runner keeps such copies of
    them. `packed`: the shapes whose weights the runner keeps packed copies of (packed.py), which `self` gets as
    their MKLDNN views; `use_live[(out, in)][bucket]` says, for such a shape, whether that many rows are
    multiplied by the view's `.rows.weight` (the weight as stored, or its transposed copy for a shape in both
    `packed` and `transposed`; by the kernel `use_onednn` names) instead of by the packed copy (oneDNN).
    `timed` measures all this on the machine; `fixed` sets it."""

    def __init__(self, use_onednn: dict[tuple[int, int], list[bool]], transposed: set[tuple[int, int]],
                 packed: set[tuple[int, int]] | None = None, use_live: dict[tuple[int, int], list[bool]] | None = None):
        self.use_onednn, self.transposed = use_onednn, transposed
        self.packed = packed or set()
        self.use_live = use_live or {}
        self.max_bucket = TIMED_MAX_ROWS.bit_length()

    @classmethod
    def fixed(cls, shapes: Sequence[tuple[int, int, bool]], transposed: bool = False,
              onednn: bool = False, packed: bool = False) -> LinearKernels:
        """Every shape given stored as is (or transposed), through BLAS (or oneDNN) for every row count. With
        `packed`, every float32 shape that a packed copy works for on this machine (`PackedLayout.of`) is
        multiplied by one instead, through oneDNN, at every row count."""
        keys = {(out_f, in_f) for out_f, in_f, _ in shapes}
        buckets = TIMED_MAX_ROWS.bit_length() + 1
        packed_keys = {k for k in keys if PackedLayout.of(*k) is not None} if packed else set()
        return cls({k: [False] + [onednn] * (buckets - 1) for k in keys}, set(keys) if transposed else set(),
                   packed_keys, {k: [False] * buckets for k in packed_keys})

    @classmethod
    def timed(cls, shapes: Sequence[tuple[int, int, bool]], dtype: torch.dtype, device: torch.device,
              onednn: bool = True, repeats: int = 5) -> LinearKernels:
        """Times every combination of storage and kernel (oneDNN, and packed copies, only with `onednn`) on
        random inputs of each weight shape, for row counts 1, 2, 4, ... TIMED_MAX_ROWS (interleaved, best of
        `repeats` calls each, fewer for large products, each call on the next of a few copies of the weight).
        A shape is given the copy (transposed or packed) that made its best kernel fastest, geometric mean over
        the row counts timed, if at least TRANSPOSED_MIN_GAIN faster than the weight as stored; then each row
        count gets the fastest of what that storage allows. Products of TIMED_MAX_MACS and more are not timed
        and use oneDNN where it is on (on the packed copy, for a packed shape), except one row, which is always
        timed: a large vocabulary's head is past the limit, and how it is stored matters most there."""
        use_onednn, use_live, transposed, packed = {}, {}, set(), set()
        second: list[tuple[float, tuple[int, int], bool]] = []  # (seconds saved per element, shape, oneDNN?)
        for out_f, in_f, has_bias in sorted(set(shapes)):
            layout = PackedLayout.of(out_f, in_f) if onednn and dtype == torch.float32 else None
            operands = _timing_operands(out_f, in_f, dtype, device, layout)
            b = torch.randn(out_f, dtype=dtype, device=device) if has_bias else None
            best: list[dict | None] = []  # per bucket from 1, {(storage, kernel): seconds}; None: not timed
            for bucket in range(1, TIMED_MAX_ROWS.bit_length() + 1):
                rows = 1 << (bucket - 1)
                macs = rows * out_f * in_f
                if rows > 1 and macs >= TIMED_MAX_MACS:  # one row always: decoding one sequence
                    best.append(None)
                    continue
                x = torch.randn(rows, in_f, dtype=dtype, device=device)
                blas = not onednn or macs < TIMED_FEW_MACS or rows <= TIMED_BLAS_MAX_ROWS
                calls = repeats if macs < TIMED_FEW_MACS else min(repeats, TIMED_FEW_REPEATS) \
                    if macs < TIMED_ONCE_MACS else 1
                best.append(_best_times(x, operands, b, onednn, calls, blas))
            timed = [t for t in best if t]
            storage = "as-is"
            if timed:
                score = {s: math.prod(_fastest(t, s)[1] for t in timed) ** (1 / len(timed))
                         for s in ("as-is", "transposed", "packed") if s in operands}
                fastest = min(score, key=score.get)
                if score[fastest] <= (1 - TRANSPOSED_MIN_GAIN) * score["as-is"]:
                    storage = fastest
            del operands
            choices = [_fastest(t, storage)[0] if t else (storage if storage == "packed" else "as-is", onednn)
                       for t in best]
            key = (out_f, in_f)
            if storage == "transposed":
                transposed.add(key)
            elif storage == "packed":
                packed.add(key)
                use_live[key] = [False] + [s != "packed" for s, _ in choices]
                one_row = best[0]
                if one_row and "transposed" in {s for s, _ in one_row}:
                    (_, kernel), seconds = _fastest(one_row, "transposed")
                    saved = _fastest(one_row, "packed")[1] - seconds
                    if saved >= SECOND_COPY_MIN_GAIN * _fastest(one_row, "packed")[1]:
                        second.append((saved / (out_f * in_f), key, kernel))
            use_onednn[key] = [False] + [kernel for _, kernel in choices]  # bucket 0 (no rows) is unused
        # second copies where they save the most time per byte, as many as fit
        room = SECOND_COPIES_MAX_BYTES
        for _, key, kernel in sorted(second, reverse=True):
            nbytes = sum(1 for o, i, _ in shapes if (o, i) == key) * key[0] * key[1] * torch.finfo(dtype).bits // 8
            if nbytes > room:
                continue
            room -= nbytes
            transposed.add(key)
            use_live[key][1] = True  # one row: the transposed copy
            use_onednn[key][1] = kernel
        return cls(use_onednn, transposed, packed, use_live)

    def without_packed(self) -> None:
        """No packed copies: those shapes multiplied by their weights as stored, through oneDNN where the
        packed copy was used (it was chosen there, so oneDNN is the better kernel for those rows)."""
        for key in self.packed:
            self.use_onednn[key] = [onednn or not live for onednn, live in zip(self.use_onednn[key],
                                                                                 self.use_live[key])]
            self.use_onednn[key][0] = False
        self.packed, self.use_live = set(), {}

    @property
    def any_onednn(self) -> bool:
        return bool(self.packed) or any(any(choices) for choices in self.use_onednn.values())

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        key = (w.shape[0], w.shape[1])
        bucket = min(x.shape[0].bit_length(), self.max_bucket)
        if w.is_mkldnn:  # a packed copy's view: oneDNN only, or the weight as stored (or transposed)
            if not self.use_live[key][bucket]:
                return linear_packed(x, w, b)
            w = w.rows.weight
        choices = self.use_onednn.get(key)
        if choices is not None and choices[bucket]:
            return _onednn_linear(x, w, b)
        return F.linear(x, w, b)

    def summary(self) -> dict[str, str]:
        """{'OUTxIN': e.g. 'transposed copy; blas for 1-32, onednn for 64+ rows'}: how each weight shape is
        stored and which kernel it uses for how many rows ('packed onednn': on the packed copy)."""
        out = {}
        for (o, i), choices in self.use_onednn.items():
            live = self.use_live.get((o, i))
            runs: list[list] = []  # [kernel, first rows, last rows]
            for bucket in range(1, len(choices)):
                kernel, rows = "onednn" if choices[bucket] else "blas", 1 << (bucket - 1)
                if live is not None and not live[bucket]:
                    kernel = "packed onednn"
                if runs and runs[-1][0] == kernel:
                    runs[-1][2] = rows
                else:
                    runs.append([kernel, rows, rows])
            runs[-1][2] = None  # the last bucket also takes every larger row count
            layout = ("packed and transposed copies; " if live and (o, i) in self.transposed else "packed copy; "
                      if live else "transposed copy; " if (o, i) in self.transposed else "")
            out[f"{o}x{i}"] = layout + ", ".join(f"{k} for {lo}+" if hi is None else f"{k} for {lo}-{hi}" if hi > lo
                                                 else f"{k} for {lo}" for k, lo, hi in runs) + " rows"
        return out


# What each storage may multiply by: its own operands ("as-is" is the weight as stored, which a packed shape
# keeps too)
_STORAGE_OPERANDS = {"as-is": ("as-is",), "transposed": ("transposed",), "packed": ("packed", "as-is")}


def _fastest(times: dict[tuple[str, bool], float], storage: str) -> tuple[tuple[str, bool], float]:
    """((operand, oneDNN?), seconds) of the fastest candidate that `storage` allows."""
    allowed = {k: t for k, t in times.items() if k[0] in _STORAGE_OPERANDS[storage]}
    key = min(allowed, key=allowed.get)
    return key, allowed[key]


def _timing_operands(out_f: int, in_f: int, dtype: torch.dtype, device: torch.device,
                     layout: PackedLayout | None) -> dict[str, list[torch.Tensor]]:
    """{storage: copies of one random weight [out_f, in_f] so stored}, enough copies to time them as a decode
    step reads them (TIMED_COLD_BYTES); "packed" (views) only with a `layout`. Uniform values: as fast to
    multiply as any others, and faster to draw than normal ones."""
    count = max(1, min(TIMED_MAX_COPIES, TIMED_COLD_BYTES // max(1, out_f * in_f * torch.finfo(dtype).bits // 8)))
    weights = [torch.empty(out_f, in_f, dtype=dtype, device=device).uniform_(-1, 1) for _ in range(count)]
    operands = {"as-is": weights, "transposed": [transposed_copy(w) for w in weights]}
    if layout is not None:
        operands["packed"] = [layout.view(relayout_copy("packed", w)) for w in weights]
    return operands


@torch.inference_mode()
def _best_times(x: torch.Tensor, operands: dict[str, list[torch.Tensor]], b: torch.Tensor | None, onednn: bool,
                repeats: int, blas: bool = True) -> dict[tuple[str, bool], float]:
    """{(storage, oneDNN?): best of `repeats` calls}, the calls interleaved (so a slow moment of the machine
    hits every candidate), after one warm-up call each; each call multiplies by the next copy in `operands`.
    BLAS only with `blas`, oneDNN only with `onednn` (one of them must be on)."""
    kernels_for = {"packed": (True,)} if onednn else {}
    kernels = tuple(k for k, on in ((False, blas), (True, onednn)) if on)
    candidates = [(s, k) for s in operands for k in kernels_for.get(s, kernels)]
    functions = {False: F.linear, True: _onednn_linear}
    run = {(s, k): (linear_packed if s == "packed" else functions[k]) for s, k in candidates}
    best = dict.fromkeys(candidates, float("inf"))
    for c in candidates:
        run[c](x, operands[c[0]][0], b)
    for i in range(repeats):
        for c in candidates:
            # a copy of the weight other than the one this storage's previous call read (copy 0 warmed up)
            w = operands[c[0]][(2 * i + c[1] + 1) % len(operands[c[0]])]
            start = time.perf_counter()
            run[c](x, w, b)
            best[c] = min(best[c], time.perf_counter() - start)
    return best
