"""Bytes: the units every figure of the plan is in, the dtypes' widths, and how the plan writes them."""

from __future__ import annotations

from collections.abc import Sequence

GIB = 2**30
MIB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _range(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"
