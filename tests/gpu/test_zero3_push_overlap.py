"""ZeRO-3's weight push gathers each bucket from the ranks' partitions and broadcasts it to the engines, the next
gather overlapping the last broadcast (pipelinerl/trainer/publisher.py, `_zero3_units`). Through DeepSpeed's
`GatheredParameters` the two could not overlap: its gather ends in a device-wide synchronize, which waits for the
broadcast in flight. Measured here, both ways, on two trainer GPUs and an engine on a third, over NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.placement import gpu_env
from pipelinerl.procs import free_port, tail

from .conftest import ROOT, engine_on_gpu, needs_gpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              needs_gpus(3, "two ZeRO-3 trainer processes and an engine of its own over NCCL")]


def test_the_direct_gather_is_not_slower_than_deepspeeds_and_overlaps_the_broadcast(tmp_path):
    from pipelinerl.models.tiny import build_tiny_model

    # ~0.4B parameters, so that a push moves enough for the overlap to show (bf16: ~0.8 GB)
    model = build_tiny_model(tmp_path / "model", hidden_size=1536, num_layers=12, num_heads=12, num_kv_heads=2,
                             seed=3)
    results = {}
    with engine_on_gpu(model, tmp_path / "engine.log", gpu=2, extra=["--dtype", "bfloat16", "--max-model-len",
                                                                      "256"]) as engine:
        for how in ("deepspeed", "direct"):
            out = tmp_path / f"{how}.json"
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   "configs/accelerate/deepspeed_zero3.yaml", "--num_processes", "2", "--main_process_port",
                   str(free_port()), str(Path(__file__).with_name("zero3_push_worker.py")), str(model), engine.url,
                   str(out)]
            env = {**os.environ, **gpu_env((0, 1), os.environ.get("CUDA_VISIBLE_DEVICES")),
                   "PIPELINERL_ZERO3_GATHER": how,
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            log = tmp_path / f"{how}.log"
            with open(log, "w") as f:
                done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
            assert done.returncode == 0, tail(log, 40)
            results[how] = json.loads(out.read_text())
    print(f"ZeRO-3 push of {model.name}: GatheredParameters {results['deepspeed']['median_s']:.3f} s, "
          f"direct gather {results['direct']['median_s']:.3f} s (median of pushes 2-5)")
    assert results["direct"]["median_s"] <= 1.05 * results["deepspeed"]["median_s"], results
