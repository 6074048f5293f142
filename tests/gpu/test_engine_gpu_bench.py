"""The embedded engine's decode on this GPU against HF generate (bench/engine_gpu.py), run briefly (`--quick`:
batches 1 and 32 at Qwen2.5-0.5B's shape): it must time both sides and read how busy the GPU was. Whether the
ratio meets the benchmark's target is the benchmark's verdict, printed, not asserted here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT, needs_gpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs_gpus(1, "the engine and HF generate on a GPU")]


def test_engine_gpu_benchmark_times_both_sides_and_the_gpu_busy_share():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "bench.engine_gpu", "--quick"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=850)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    wrote = re.search(r"^wrote (.+)$", result.stdout, re.MULTILINE)
    assert wrote, result.stdout
    measured = json.loads((ROOT / wrote.group(1).strip()).read_text())
    print(measured["table"], measured["summary"], sep="\n")
    assert [r["batch"] for r in measured["rows"]] == [1, 32]
    assert all(r["engine_ms"] > 0 and r["hf_ms"] > 0 for r in measured["rows"]), measured["rows"]
    assert 0 < measured["gpu_busy"] <= 1.0 and measured["kernels_per_step"] > 0, measured
