"""Sizes of a run beyond GPU memory, from its model's parameter count: how long an engine may take to start, how
large a checkpoint is and the disk its run directory needs. `pipelinerl plan` prints them; the launcher gives the
engines that deadline and refuses, before anything starts, a run directory whose filesystem cannot hold the
checkpoints (a 32B run would otherwise fail at its first save, 30 minutes in, or worse at its second).

Pure arithmetic (no torch, no files): the callers pass the parameter count (`plan.model_shape(cfg).num_params`)
and how the trainer is sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelinerl.config import RunConfig

GB = 10**9
# An engine reading its weights from shared storage while the node's other engines read theirs: a pessimistic
# 100 MB/s each (a parallel filesystem gives several GB/s to a node, a busy NFS far less).
ENGINE_READ_BYTES_PER_S = 100e6
# Python's and CUDA's start, vLLM's torch.compile and CUDA-graph capture, KV-cache allocation: minutes on a GPU.
ENGINE_START_FIXED_S = 420.0
MIN_ENGINE_START_S = 900.0  # the deadline of a small model (and of every CPU recipe)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def engine_start_timeout_s(cfg: RunConfig, num_params: int) -> float:
    """`engine.start_timeout_s`, or where unset the time an engine of this model is given to start: its weights
    read at ENGINE_READ_BYTES_PER_S plus ENGINE_START_FIXED_S, at least MIN_ENGINE_START_S, in whole minutes."""
    if cfg.engine.start_timeout_s is not None:
        return float(cfg.engine.start_timeout_s)
    weights = num_params * DTYPE_BYTES.get(cfg.model.dtype, 2)
    seconds = weights / ENGINE_READ_BYTES_PER_S + ENGINE_START_FIXED_S
    return max(MIN_ENGINE_START_S, 60.0 * math.ceil(seconds / 60.0))


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint (`accelerator.save_state` of every model, the KL reference, the trainer's state)."""

    policy: int
    critic: int
    reference: int
    bytes_per_param: int  # of the policy and the critic: weights + optimizer state as saved

    @property
    def total(self) -> int:
        return self.policy + self.critic + self.reference

    def describe(self) -> str:
        parts = [f"policy {_gb(self.policy)}"]
        if self.critic:
            parts.append(f"critic {_gb(self.critic)}")
        if self.reference:
            parts.append(f"KL reference {_gb(self.reference)}")
        return f"{_gb(self.total)} ({', '.join(parts)}; {self.bytes_per_param} B per parameter with the optimizer)"


def checkpoint_size(cfg: RunConfig, num_params: int, deepspeed: bool, bf16: bool) -> CheckpointSize:
    """What a checkpoint holds per model: under DeepSpeed with bf16 the bf16 weights (2 B per parameter) and the
    optimizer's fp32 master weights and two moments (12 B); otherwise the fp32 weights (4 B) and two moments (8 B).
    A critic (`trainer.advantage: gae`) is a second model of the same size; a KL reference is saved in the engines'
    dtype."""
    per_param = 2 + 12 if deepspeed and bf16 else 4 + 8
    policy = num_params * per_param
    critic = policy if cfg.trainer.advantage == "gae" else 0
    reference = num_params * DTYPE_BYTES.get(cfg.model.dtype, 2) if cfg.trainer.kl_coef > 0 else 0
    return CheckpointSize(policy, critic, reference, per_param)


def checkpoints_on_disk(cfg: RunConfig) -> int:
    """Checkpoints on disk at once at most: `trainer.keep_checkpoints` complete ones and the one being written
    (it is pruned after its save completes). With keep_checkpoints 0 (keep all), as many as the run saves by step
    count, at least two."""
    keep = cfg.trainer.keep_checkpoints
    if keep > 0:
        return keep + 1
    t = cfg.trainer
    return max(2, t.max_steps // t.save_every + 1 if t.save_every else 2)


def disk_problem(cfg: RunConfig, size: CheckpointSize, free_bytes: int, where: str) -> tuple[str | None, str | None]:
    """(problem, warning) for a run directory on a filesystem with `free_bytes` free: a problem when it cannot hold
    two checkpoints (saving the second would fail with the first one's space taken), a warning when it cannot
    hold as many as the run keeps at once."""
    two, peak = 2 * size.total, checkpoints_on_disk(cfg) * size.total
    if free_bytes < two:
        return (f"run_dir: {where} has {_gb(free_bytes)} free, and two checkpoints of this run take {_gb(two)} "
                f"(one is {size.describe()}); free space there, or point run_dir at a larger filesystem"), None
    if free_bytes < peak:
        return None, (f"run_dir: {where} has {_gb(free_bytes)} free, less than the {_gb(peak)} of the "
                      f"{checkpoints_on_disk(cfg)} checkpoints the run holds at once (trainer.keep_checkpoints "
                      f"{cfg.trainer.keep_checkpoints} and the one being written); a save will fail when it fills up")
    return None, None


def disk_size(n: float) -> str:
    """Bytes in decimal units, as disks are sold (GB, TB)."""
    return _gb(n)


def _gb(n: float) -> str:
    if n >= 1000 * GB:
        return f"{n / 1e12:.2f} TB"
    if n >= GB:
        return f"{n / GB:.1f} GB"
    return f"{n / 1e6:.1f} MB"
