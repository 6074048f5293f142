"""Gradient accumulation and the optimizer update of one accelerate-prepared model, plain, DDP, DeepSpeed or FSDP.

The policy and the critic train the same way: several micro-batches accumulate gradients, all-reduced once after
the last, then clip, check for NaN/inf, and step. DeepSpeed wants its own engine's calls for each of these.
"""

from __future__ import annotations

import contextlib
import math

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import Tensor, nn


def is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def no_grad_sync_unless(accelerator: Accelerator, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Gradients are all-reduced once, after the last micro-batch (DeepSpeed decides this itself)."""
    if last or is_deepspeed(accelerator):
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def poisoned_unless_finite(loss: Tensor) -> Tensor:
    """`loss` itself where it is finite; where it is not, a loss whose gradients are NaN wherever it has any.

    Why: a step is skipped when its global gradient norm is not finite (`apply_update`, and DeepSpeed's own check
    inside `step()`), and that norm is taken after the gradients are reduced over the trainer's ranks, so every rank
    sees the same verdict. A loss that is NaN or inf on one rank while its gradients stay finite (an inf from a term
    that does not depend on the weights) would pass that check and be applied; poisoning its gradients turns it into
    the case every rank and every sharding already skips alike. No host synchronisation: the check stays on the
    device."""
    poison = torch.where(torch.isfinite(loss.detach()), 0.0, float("nan")).to(loss.dtype)
    return loss + poison * loss


def backward(accelerator: Accelerator, model: nn.Module, loss: Tensor, last: bool) -> None:
    """Accumulate `loss`'s gradients; `last` marks the micro-batch after which the update comes."""
    if is_deepspeed(accelerator):  # the engine accumulates until we declare the boundary
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss)
    else:
        accelerator.backward(loss)


def apply_update(accelerator: Accelerator, model: nn.Module, optimizer, grad_clip: float,
                 loss_finite: bool) -> tuple[bool, float]:
    """Clip, check, step the optimizer: (applied, pre-clip gradient norm). Nothing changes when it is not applied.

    `grad_clip` <= 0 clips nothing. Under DeepSpeed the engine clips (its config's `gradient_clipping`, which the
    trainer sets from `trainer.grad_clip`) and skips a step whose global gradient norm is not finite (ZeRO-3's
    `step()` takes that as an overflow, in bf16 as in fp16, and clears the gradients). `loss_finite` (all-reduced by
    the caller, so alike on every rank) is checked here too; a loss that went through `poisoned_unless_finite`
    cannot be non-finite with finite gradients."""
    if is_deepspeed(accelerator):
        model.step()
        grad_norm = model.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return bool(model.was_step_applied()), grad_norm
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
    if not (loss_finite and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True, grad_norm
