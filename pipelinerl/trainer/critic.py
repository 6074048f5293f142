"""The critic of PPO with a value model (`trainer.advantage: gae`, ORZ's method).

A value model is the policy's base model with a scalar head (`AutoModelForTokenClassification`, one label),
loaded from the same checkpoint as the policy, with its own AdamW (`trainer.critic.lr`). It is prepared by the
trainer's accelerator like the policy, so it is sharded the same way (ZeRO-3, FSDP) and `accelerator.save_state`
checkpoints it with the policy.

Per trainer step, inside `Trainer.optimizer_step`:

    values V(s_t) of every token, no gradient (`add_values`, before any update)
    -> GAE advantages and returns from the rewards and V (`set_gae_advantages`), normalised over the batch
    -> the policy's updates
    -> `trainer.critic.updates` critic updates, one pass over the batch, regressing V on the returns with the
       clipped value loss (`update`)

The head starts at zero, so the first values are all 0 and the first advantages are the whitened returns: no
random offset from a fresh head leaks into the first policy updates.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForTokenClassification

from pipelinerl.config import TrainerConfig
from pipelinerl.rl.packing import PackedBatch, build_packed_batch, packed_model_inputs
from pipelinerl.rl.values import gae_advantages, value_loss
from pipelinerl.trainer import update
from pipelinerl.trainer.batch import MicroBatch, StepBatch
from pipelinerl.trainer.linear_kernels import route_linears
from pipelinerl.trainer.optim import build_optimizer

log = logging.getLogger(__name__)


class Critic:
    """V(s) for every token, GAE from it, and its own training on the returns."""

    def __init__(self, model_path: str, cfg: TrainerConfig, accelerator: Accelerator, attn_implementation: str,
                 onednn_shapes: set[tuple[int, int]] | None = None, seed: int = 0, fused_adamw: bool = False):
        self.cfg, self.critic_cfg, self.accelerator = cfg, cfg.critic, accelerator
        self.seed = seed
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0  # a regression target: no dropout on the head (transformers' default 0.1)
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                                attn_implementation=attn_implementation)
        model.config.use_cache = False
        _zero_(model.score)
        route_linears(model, onednn_shapes or set())  # the policy's choice (linear_kernels.py)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = build_optimizer(model, cfg, lr=self.critic_cfg.lr, fused=fused_adamw)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self._config = accelerator.unwrap_model(self.model).config
        self._impl = getattr(self._config, "_attn_implementation", None)

    # --- values and advantages --------------------------------------------------------------------------------

    def values(self, p: PackedBatch, attention: str = "auto") -> Tensor:
        """V(s_t) for every token t of a packed row, ``[T]`` float32, aligned with ``input_ids`` as log-probs are:
        the value of the state before token t is the head's output after token t - 1 of t's sequence (0 at a
        sequence's first token, which no state precedes). `attention`: the row's layout (`rl.packing`; "auto"
        chooses padded rows or one row under a block-diagonal mask, as for the policy)."""
        dtype = next(self.model.parameters()).dtype
        kwargs, index = packed_model_inputs(p, self._impl, attention, self._config, dtype)
        with self.accelerator.autocast():
            per_token = self.model(**kwargs).logits[..., 0].reshape(-1).float()
        positions = p.label_mask.nonzero().squeeze(1)
        before = positions - 1 if index is None else index[positions] - 1  # the output after token t - 1
        return per_token.new_zeros(p.input_ids.shape[1]).index_put((positions,), per_token[before])

    @torch.no_grad()
    def add_values(self, micro_batches: list[MicroBatch]) -> None:
        """The values before this step's critic updates (`old_values`): what GAE uses and value clipping keeps
        the updated values near."""
        for mb in micro_batches:
            mb.packed.fields["old_values"] = self.values(mb.packed)

    @torch.no_grad()
    def set_gae_advantages(self, step: StepBatch, micro_batches: list[MicroBatch], kl_coef: float
                           ) -> dict[str, float]:
        """Every token's `advantages` and `returns` by GAE (`pipelinerl.rl.values.gae_advantages`), from the
        sample's reward on its last trained token and, with `kl_coef` > 0 (`trainer.kl_in_reward`), a KL penalty
        of `kl_coef * kl_behav` on every trained token. With `critic.whiten_advantages` the advantages are then
        normalised to mean 0 and std 1 over the trained tokens of the whole batch (all ranks). Returns stats."""
        c = self.critic_cfg
        sums = torch.zeros(7, dtype=torch.float64, device=self.accelerator.device)
        for mb in micro_batches:
            p, f = mb.packed, mb.packed.fields
            mask = f["loss_mask"]
            token_rewards = torch.zeros_like(f["old_values"])
            if kl_coef > 0:
                token_rewards -= kl_coef * f["kl_behav"]
            token_rewards += _on_last_action(step.rewards[mb.sample_indices].to(token_rewards), mask, p.seq_ids)
            f["advantages"], f["returns"] = gae_advantages(token_rewards, f["old_values"], mask, p.seq_ids,
                                                           c.gamma, c.lam)
            if mb.weight:
                adv, ret, v = f["advantages"][mask], f["returns"][mask], f["old_values"][mask]
                sums += torch.stack([mask.sum(), adv.sum(), adv.square().sum(), ret.sum(), ret.square().sum(),
                                     (ret - v).sum(), (ret - v).square().sum()]).to(sums)
        if self.accelerator.num_processes > 1:
            dist.all_reduce(sums)
        n, adv_sum, adv_sq, ret_sum, ret_sq, err_sum, err_sq = sums.tolist()
        n = max(n, 1.0)
        mean, var = adv_sum / n, max(adv_sq / n - (adv_sum / n) ** 2, 0.0)
        ret_var = max(ret_sq / n - (ret_sum / n) ** 2, 0.0)
        err_var = max(err_sq / n - (err_sum / n) ** 2, 0.0)
        if c.whiten_advantages:
            for mb in micro_batches:
                f = mb.packed.fields
                whitened = (f["advantages"] - mean) / (math.sqrt(var) + 1e-8)
                f["advantages"] = torch.where(f["loss_mask"], whitened, torch.zeros_like(whitened))
        return {"critic_returns_mean": ret_sum / n,
                # the critic loss of values that only know the mean return is 0.5 * this
                "critic_returns_var": ret_var,
                # 1 - Var(R - V) / Var(R): the share of the returns' variance the values explain (1 is perfect)
                "critic_explained_var": 1.0 - err_var / ret_var if ret_var > 0 else 0.0}

    # --- training ----------------------------------------------------------------------------------------------

    def lr_at(self, step: int, update: int = 0) -> float:
        """The critic's learning rate at its `update`-th update of trainer step `step` (both 0-based): linear warm-up
        over `critic.warmup_updates` optimizer updates, then constant (ORZ's schedule, stepped per optimizer update).
        Derived from the trainer's step, so a resumed run continues it."""
        c = self.critic_cfg
        done = step * c.updates + update
        return c.lr * min(1.0, (done + 1) / c.warmup_updates) if c.warmup_updates else c.lr

    def update(self, micro_batches: list[MicroBatch], step: int = 0) -> dict[str, float]:
        """`critic.updates` optimizer updates, one pass over the step's samples split into that many parts (ORZ's
        `critic_update_steps`; each data-parallel rank splits its own share, as ORZ's ranks split their buffers),
        in a random order seeded by the run's seed and `step` (`critic.shuffle`); each regresses V on the returns
        with the clipped value loss, its token mean over the part's trained tokens on all ranks. A NaN/inf update
        is skipped."""
        acc = self.accelerator
        groups = self._update_groups(micro_batches, step)
        losses, clip_fracs, grad_norms, applied = [], [], [], 0
        self.model.train()
        for k, group in enumerate(groups):
            lr = self.lr_at(step, k)
            for param_group in self.optimizer.param_groups:
                param_group["lr"] = lr
            tokens = sum(mb.packed.fields["loss_mask"].sum() for mb in group if mb.weight)
            tokens = torch.as_tensor(tokens, dtype=torch.float64, device=acc.device)
            if acc.num_processes > 1:
                dist.all_reduce(tokens)
            sums = torch.zeros(2, dtype=torch.float64, device=acc.device)
            for i, mb in enumerate(group):
                last = i == len(group) - 1
                with update.no_grad_sync_unless(acc, self.model, last):
                    f = mb.packed.fields
                    mask = f["loss_mask"]
                    per_token, clipped = value_loss(self.values(mb.packed), f["old_values"], f["returns"],
                                                    self.critic_cfg.value_clip)
                    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / tokens.clamp(min=1)
                    # DDP / ZeRO / FSDP average gradients over ranks: scale back up to the sum
                    update.backward(acc, self.model, update.poisoned_unless_finite(loss) * acc.num_processes
                                    * mb.weight, last)
                if mb.weight:
                    sums += torch.stack([loss.detach(), (clipped & mask).sum()]).to(sums)
            if acc.num_processes > 1:
                dist.all_reduce(sums)
            ok, grad_norm = update.apply_update(acc, self.model, self.optimizer, self.cfg.grad_clip,
                                                math.isfinite(float(sums[0])))
            if not ok:
                log.warning("critic update skipped: non-finite loss (%s) or gradient norm (%s)", float(sums[0]),
                            grad_norm)
            applied += ok
            losses.append(float(sums[0]))
            clip_fracs.append(float(sums[1] / tokens.clamp(min=1)))
            grad_norms.append(grad_norm)
        # each group's loss is taken before its own update, on data the critic has not been fitted on this step
        return {"critic_loss": sum(losses) / len(losses),
                "critic_value_clip_frac": sum(clip_fracs) / len(clip_fracs), "critic_grad_norm": grad_norms[-1],
                "critic_updates_applied": float(applied), "critic_lr": lr}

    def _update_groups(self, micro_batches: list[MicroBatch], step: int = 0) -> list[list[MicroBatch]]:
        """This rank's samples (with their values and returns) in `critic.updates` parts, each packed into
        micro-batches of at most `trainer.micro_batch_tokens`. Every rank makes as many parts (fewer updates if a
        rank has fewer samples than that), each of as many micro-batches: ZeRO-3 and FSDP gather parameters
        collectively in every forward and backward, so zero-weight padding passes even the counts out."""
        keys = ("loss_mask", "old_values", "returns")
        samples = []  # (token ids, {field: values}) of each sample this rank trains on
        for mb in micro_batches:
            if not mb.weight:
                continue
            p = mb.packed
            ids = p.input_ids[0].split(p.lengths)
            fields = {k: p.fields[k].split(p.lengths) for k in keys}
            samples += [(ids[j].tolist(), {k: fields[k][j] for k in keys}) for j in range(p.num_sequences)]
        parts = self._all_reduce_int(max(1, min(self.critic_cfg.updates, len(samples))), dist.ReduceOp.MIN)
        if self.critic_cfg.shuffle and parts > 1:  # (one part is the whole batch in any order)
            # the same order on a rerun and a resume; a rank shuffles its own share
            random.Random(f"{self.seed}/{step}/{self.accelerator.process_index}").shuffle(samples)
        groups = [self._pack(part) for part in _split(samples, parts)]
        filler = MicroBatch(micro_batches[0].packed, [], weight=0.0)
        for group in groups:
            count = self._all_reduce_int(len(group), dist.ReduceOp.MAX)
            group += [filler] * (count - len(group))
        return groups

    def _pack(self, samples: list) -> list[MicroBatch]:
        """Samples into packed rows of at most `trainer.micro_batch_tokens` tokens (a longer sample alone)."""
        rows, row, tokens = [], [], 0
        for ids, fields in samples:
            if row and tokens + len(ids) > self.cfg.micro_batch_tokens:
                rows.append(row)
                row, tokens = [], 0
            row.append((ids, fields))
            tokens += len(ids)
        if row:
            rows.append(row)
        device = self.accelerator.device
        return [MicroBatch(build_packed_batch([ids for ids, _ in row],
                                              {k: [f[k] for _, f in row] for k in row[0][1]}, device),
                           [], weight=1.0) for row in rows]

    def _all_reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor(value, device=self.accelerator.device)
        dist.all_reduce(t, op=op)
        return int(t)


def _on_last_action(rewards: Tensor, mask: Tensor, seq_ids: Tensor) -> Tensor:
    """``[T]`` with each sequence's reward on its last action token (``mask``) and 0 elsewhere; a sequence with
    no action (left out by overlong filtering) gets nothing."""
    out = torch.zeros(mask.shape[0], dtype=rewards.dtype, device=rewards.device)
    actions = mask.nonzero().squeeze(1)
    if actions.numel() == 0:
        return out
    last = torch.full((rewards.shape[0],), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(0, seq_ids[actions], actions, reduce="amax")
    has = last >= 0
    out[last[has]] = rewards[has]
    return out


def _split(items: list, parts: int) -> list[list]:
    """`parts` contiguous runs of `items`, their sizes differing by at most one (some empty if there are fewer
    items than parts)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


@torch.no_grad()
def _zero_(module: nn.Module) -> None:
    """Zero a module's parameters, gathering them first where ZeRO-3 has partitioned them at load."""
    params = list(module.parameters())
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered:
        for p in params:
            p.zero_()
