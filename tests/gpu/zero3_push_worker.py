"""A ZeRO-3 trainer process that pushes its weights to an engine a few times and records how long each push took
(tests/gpu/test_zero3_push_overlap.py launches two of them with `accelerate launch`)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(model_dir: str, engine_url: str, out: str, pushes: int = 5) -> None:
    from pipelinerl.config import TrainerConfig, WeightSyncConfig
    from pipelinerl.trainer import Trainer

    trainer = Trainer(model_dir, TrainerConfig(mixed_precision="bf16", samples_per_step=4),
                      WeightSyncConfig(backend="nccl", bucket_mb=64, timeout_s=300), dtype="bfloat16", seed=1)
    group = trainer.connect_engines([engine_url])
    seconds = []
    for _ in range(pushes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.broadcast_weights(group, [engine_url])
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if trainer.accelerator.is_main_process:
        Path(out).write_text(json.dumps({"seconds": seconds, "median_s": statistics.median(seconds[1:])}))
        group.destroy()
    trainer.close()


if __name__ == "__main__":
    from pipelinerl.train import exit_now

    main(*sys.argv[1:])
    exit_now()
