"""AdamW and its learning-rate schedule: linear warm-up, then constant or cosine decay to zero at `max_steps`.

Kept as plain torch objects so that accelerate (and DeepSpeed / FSDP behind it) can wrap the optimizer, and the
scheduler can be checkpointed with `state_dict()` like any other torch scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pipelinerl.config import TrainerConfig


def lr_factor(step: int, warmup_steps: int, max_steps: int, schedule: str) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Warm-up ramps linearly over the first `warmup_steps` steps (step 0 already gets a non-zero rate, so no
    step is wasted); after it the rate stays at 1 ("constant") or follows a half cosine down to 0 at
    `max_steps` ("cosine").
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        decay_steps = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; expected constant or cosine")


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices get weight decay, biases and norm gains (1-D) do not, as in nanoGPT.

    Decaying a norm gain or a bias towards 0 only fights the model's own scale, it does not regularise.
    """
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition is flat; ds_shape is the real one
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainerConfig, lr: float | None = None, fused: bool = False
                    ) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters with the configured betas and weight decay, at `lr` (default
    `cfg.lr`). `fused`: torch's one-kernel AdamW, for plain CPU tensors (the trainer asks for it there): on CPU
    torch's default is a loop of a dozen operations per tensor, 3-6x slower (the same values to an ulp); on GPUs
    torch's own default (foreach) stays, and DeepSpeed and FSDP step their own way."""
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW(param_groups(model.named_parameters(), cfg.weight_decay),
                             lr=cfg.lr if lr is None else lr, betas=betas, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_factor`; step it once per applied optimizer step (never on a skipped one)."""
    warmup, max_steps, schedule = cfg.warmup_steps, cfg.max_steps, cfg.schedule

    def factor(step: int) -> float:
        return lr_factor(step, warmup, max_steps, schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
