"""The trainer: one policy, one AdamW, one optimizer step per batch of scored samples, weights pushed to engines.

accelerate is both the launcher and the wrapper: on a laptop `Accelerator(cpu=True)` leaves the model as it is
(fp32); on GPUs the same code runs under DeepSpeed ZeRO-3 or FSDP from `launch/accelerate/*.yaml` (bf16). The
few places where sharding matters (gathering full parameters, the DeepSpeed backward/step) are marked.

`optimizer_step` reads top to bottom:

    batch -> validate -> advantages per group -> pack this rank's share into micro-batches
          -> [decoupled PPO: proximal log-probs, no grad] -> [KL: reference log-probs, no grad]
          -> per micro-batch: log-probs -> policy loss (+ KL) -> aggregate -> backward (accumulate)
          -> clip -> NaN/inf check -> optimizer + scheduler step -> version += 1 -> [reference reset]
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env, set_seed
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from pipelinerl.config import TrainerConfig, WeightSyncConfig
from pipelinerl.contracts.trainer import BroadcastStats
from pipelinerl.rl.kl import ReferenceResetPolicy, kl_estimate, reset_reference
from pipelinerl.rl.losses import (
    aggregate,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_is_loss,
)
from pipelinerl.rl.packing import (
    PackedBatch,
    packed_logprobs,
    packed_logprobs_and_entropy,
    resolve_attn_implementation,
)
from pipelinerl.samples import Sample
from pipelinerl.trainer.batch import MicroBatch, StepBatch, build_step, filler_micro_batch, pad_micro_batches
from pipelinerl.trainer.optim import build_optimizer, build_scheduler
from pipelinerl.trainer.publisher import WeightPublisher
from pipelinerl.weight_sync import DTYPES, WeightUpdateGroup

log = logging.getLogger(__name__)

# Sums over trained tokens that make up the step's stats (reduced across data-parallel ranks).
_SUM_KEYS = ("loss", "tokens", "kl", "entropy", "clip_low", "clip_high", "w", "w2")


def make_accelerator(cfg: TrainerConfig) -> Accelerator:
    """CPU and fp32 where there is no GPU; on GPUs, what `accelerate launch --config_file ...` set up, with bf16
    unless `trainer.mixed_precision` says otherwise.

    A DeepSpeed launch (`ACCELERATE_USE_DEEPSPEED`, set by `accelerate launch` from a DeepSpeed config) also
    runs without a GPU, on gloo. accelerate only selects DeepSpeed when not forced to the CPU (forced, the
    processes would silently train as plain data parallel), and without a GPU it picks no process-group backend
    of its own (each process would then think it is alone), so it is told gloo. DeepSpeed's CPU accelerator
    (chosen when no GPU is found) also uses gloo when oneCCL is not installed.

    The trainer processes' collectives time out after `trainer.collective_timeout_s` (torch's default is 10 minutes
    for NCCL); work the main process does alone is waited for at the host barrier of `ranks`, opened here, with
    its own timeout (`trainer.main_process_timeout_s`), so no rank sits in a collective meanwhile."""
    from datetime import timedelta

    from pipelinerl.trainer.ranks import open_host_barrier

    cpu = not torch.cuda.is_available()
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = "no" if cpu else "bf16"
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    if cpu and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        accelerator = Accelerator(mixed_precision=mixed,
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)])
    else:
        accelerator = Accelerator(cpu=cpu, mixed_precision=mixed,
                                  kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    open_host_barrier(cfg.main_process_timeout_s)
    return accelerator


@contextlib.contextmanager
def zero3_hidden_from_transformers() -> Iterator[None]:
    """Make transformers act as if ZeRO-3 were off: load the frozen reference whole (not partitioned by
    `zero.Init`, which is only right for the model DeepSpeed wraps), and save an export from the main
    process alone (no collective gathers inside `save_pretrained`)."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


class Trainer:
    """Implements `pipelinerl.contracts.trainer.TrainerBackend` on accelerate.

    `dtype` is the dtype of the weights that leave the trainer (broadcasts to engines, exports, the frozen
    reference model): the engines' dtype. Master weights and optimizer state are always float32.
    """

    def __init__(self, model_path: str, cfg: TrainerConfig | None = None,
                 weight_sync: WeightSyncConfig | None = None, dtype: str = "float32", seed: int = 0,
                 accelerator: Accelerator | None = None):
        self.cfg = cfg or TrainerConfig()
        self.sync_cfg = weight_sync or WeightSyncConfig()
        self.model_path = str(model_path)
        self.weights_dtype = DTYPES[dtype]
        self.accelerator = accelerator or make_accelerator(self.cfg)
        # kept: close() must work even after accelerate's process-wide state was reset (tests do)
        self._num_processes = self.accelerator.num_processes
        set_seed(seed)
        if self.accelerator.device.type == "cpu":
            torch.set_num_threads(self.cfg.threads)

        # "auto": flash-attention 2 on GPUs where it is installed (no dense mask over packed rows), else sdpa
        self.attn_implementation = resolve_attn_implementation(self.cfg.attn_implementation, self.accelerator.device,
                                                               self.cfg.micro_batch_tokens)
        model = self._load_policy()
        self.param_names = [name for name, _ in model.named_parameters()]  # tied weights appear once
        optimizer = build_optimizer(model, self.cfg)
        self.scheduler = build_scheduler(optimizer, self.cfg)  # stepped by us, never by accelerate
        self._configure_deepspeed()
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        # Packed rows need a block-diagonal mask, which packed_logprobs builds from the model's config; a DDP
        # wrapper hides the config, and then transformers detects packing from the restarting position ids.
        self._attention = "auto" if hasattr(self.model, "config") else "position_ids"

        self.ref_model = self._load_reference() if self.cfg.kl_coef > 0 else None
        self.ref_resets = ReferenceResetPolicy(every_n_steps=self.cfg.ref_reset_every or None)
        self._version = 0
        self.step = 0  # optimizer_step calls, skipped ones included

    # --- setup -----------------------------------------------------------------------------------------------

    def _load_policy(self) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32,
                                                     attn_implementation=self.attn_implementation)
        model.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _load_reference(self) -> nn.Module:
        """The frozen KL reference: a whole (unsharded) copy in the engines' dtype on every rank."""
        with zero3_hidden_from_transformers():
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.weights_dtype,
                                                       attn_implementation=self.attn_implementation)
        ref.config.use_cache = False
        return ref.to(self.accelerator.device).eval().requires_grad_(False)

    def _configure_deepspeed(self) -> None:
        """Our config decides clipping; we drive accumulation boundaries ourselves (micro-batch counts vary)."""
        if not self.is_deepspeed:
            return
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        ds["gradient_clipping"] = self.cfg.grad_clip if self.cfg.grad_clip > 0 else 0.0
        ds["gradient_accumulation_steps"] = 1
        if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds["train_micro_batch_size_per_gpu"] = 1

    @property
    def is_deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def is_zero3(self) -> bool:
        return self.is_deepspeed and self.accelerator.state.deepspeed_plugin.zero_stage == 3

    @property
    def is_fsdp(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP

    @property
    def unwrapped_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def version(self) -> int:
        """Weight version of the current parameters: 0 for the initial model, +1 per applied optimizer step."""
        return self._version

    @property
    def bucket_bytes(self) -> int:
        return self.publisher.bucket_bytes

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- the weight path: all in `publisher.WeightPublisher` ---------------------------------------------------

    @functools.cached_property
    def publisher(self) -> WeightPublisher:
        sharding = "zero3" if self.is_zero3 else "fsdp" if self.is_fsdp else "none"
        return WeightPublisher(self.model, self.unwrapped_model, sharding, self.weights_dtype, self.sync_cfg,
                               self.accelerator.is_main_process)

    def full_parameters(self, all_ranks: bool = False, device: torch.device | str | None = None
                        ) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) for every parameter in the engines' dtype, tied weights once
        (`WeightPublisher.full_parameters`). Collective when the model is sharded: every rank iterates it."""
        return self.publisher.full_parameters(all_ranks, device)

    def connect_engines(self, engine_urls: Sequence[str], ranks_per_engine: int = 1) -> WeightUpdateGroup | None:
        """Form the weight-update group with the engines (main process = rank 0); other ranks get None."""
        return self.publisher.connect(engine_urls, ranks_per_engine)

    def broadcast_weights(self, group: WeightUpdateGroup | None, engine_urls: Sequence[str]) -> BroadcastStats:
        """Send the current weights as version `self.version` to every engine; return once all switched. All
        trainer ranks call it (gathering sharded parameters is collective); only the main process talks to
        engines."""
        return self.publisher.publish(group, engine_urls, self.version)

    def lay_out_for_broadcast(self) -> bool:
        """See `WeightPublisher.lay_out_for_broadcast`."""
        return self.publisher.lay_out_for_broadcast()

    def close(self) -> None:
        """Close the engine connections and leave the trainer ranks' process group. Every rank calls it, last.

        A gloo group left to interpreter shutdown can abort the process from a C++ worker thread ("terminate
        called without an active exception": seen in about one run in eight of two DeepSpeed ranks on CPU)."""
        from pipelinerl.trainer.ranks import close_host_barrier, host_barrier

        if "publisher" in self.__dict__:  # made on first use (cached_property): nothing to close otherwise
            self.publisher.close()
        if self._num_processes > 1 and dist.is_initialized():
            # no rank tears the groups down while another may still be using them; the main process may still be
            # finishing its own work (closing the engine connections, the reward pool), so meet on the host
            host_barrier("the end of the run")
            close_host_barrier()
            dist.destroy_process_group()

    # --- the optimizer step ---------------------------------------------------------------------------------

    def optimizer_step(self, batch: Sequence[Sample | Mapping[str, Any]]) -> dict[str, float]:
        """One optimizer step on a batch of scored samples (see the module docstring for the flow).

        Raises ValueError naming the sample for a batch it cannot train on. A NaN/inf loss or gradient skips
        the update (weights, optimizer state and version untouched) and returns stats with `skipped` = 1.
        """
        start = time.perf_counter()
        cfg, acc = self.cfg, self.accelerator
        step = build_step(batch, cfg.advantage, cfg.micro_batch_tokens, acc.process_index, acc.num_processes,
                          acc.device)
        micro_batches = self._same_count_on_all_ranks(step)
        lags = [s.lag(self.version) for s in step.samples]
        lr = self.lr
        self.model.train()

        if cfg.policy_loss == "decoupled_ppo":
            self._add_logprobs(self.model, micro_batches, "prox_logprobs", self._attention)
        if self.ref_model is not None:
            self._add_logprobs(self.ref_model, micro_batches, "ref_logprobs", "auto")

        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=acc.device)
        w_max = torch.zeros((), dtype=torch.float64, device=acc.device)
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._no_grad_sync_unless(last):
                loss, mb_sums, mb_w_max = self._micro_batch_loss(mb, step)
                # DDP / ZeRO / FSDP average gradients over ranks; each rank's loss already has the whole
                # step's denominator, so scale back up to get the sum.
                self._backward(loss * acc.num_processes * mb.weight, last)
            if mb.weight:
                sums += mb_sums
                w_max = torch.maximum(w_max, mb_w_max)
        sums, w_max = self._reduce(sums, w_max)
        totals = dict(zip(_SUM_KEYS, sums.tolist()))

        applied, grad_norm = self._apply_update(math.isfinite(totals["loss"]))
        self.step += 1
        ref_reset = False
        if applied:
            self._version += 1
            ref_reset = self._maybe_reset_reference()
        else:
            log.warning("step %d: non-finite loss (%s) or gradient norm (%s); update skipped, weights and "
                        "version %d kept", self.step, totals["loss"], grad_norm, self.version)
        return self._stats(step, totals, float(w_max), grad_norm, lags, lr, applied, ref_reset,
                           len(micro_batches), time.perf_counter() - start)

    def _same_count_on_all_ranks(self, step: StepBatch) -> list[MicroBatch]:
        """Pad this rank's micro-batches with zero-weight ones so every rank runs as many passes (sharded
        models gather parameters collectively in every forward and backward)."""
        mbs = step.micro_batches
        if self.accelerator.num_processes == 1:
            return mbs
        count = torch.tensor(len(mbs), device=self.accelerator.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count) == len(mbs):
            return mbs
        filler = filler_micro_batch(step, self.cfg.micro_batch_tokens, self.accelerator.device)
        return pad_micro_batches(mbs, int(count), filler)

    @torch.no_grad()
    def _add_logprobs(self, model: nn.Module, micro_batches: list[MicroBatch], field: str, attention: str) -> None:
        """Log-probs of every token under `model` before the update (proximal policy, or KL reference)."""
        with self.accelerator.autocast():
            for mb in micro_batches:
                mb.packed.fields[field] = packed_logprobs(model, mb.packed, self.cfg.temperature, attention,
                                                          self.cfg.logprob_chunk_tokens)

    def _micro_batch_loss(self, mb: MicroBatch, step: StepBatch) -> tuple[Tensor, Tensor, Tensor]:
        """The micro-batch's share of the step loss, plus its stat sums (in `_SUM_KEYS` order) and max IS weight."""
        cfg, p = self.cfg, mb.packed
        mask = p.fields["loss_mask"]
        # the LM head runs in chunks (no [tokens, vocab] logits); the entropy stat comes from the same chunks
        logprobs, entropy = packed_logprobs_and_entropy(self.model, p, cfg.temperature, self._attention,
                                                        cfg.logprob_chunk_tokens)
        per_token, loss_stats = self._policy_loss(logprobs, p)
        kl = torch.zeros_like(logprobs)
        if self.ref_model is not None:
            kl = torch.where(mask, kl_estimate(logprobs, p.fields["ref_logprobs"], cfg.kl_estimator), kl)
            per_token = per_token + cfg.kl_coef * kl
        loss = aggregate(per_token, mask, cfg.aggregation, num_sequences=self._num_sequences(step),
                         seq_ids=p.seq_ids, num_tokens=step.num_output_tokens)

        with torch.no_grad():
            tokens = mask.sum()
            w = torch.where(mask, torch.exp(logprobs - p.fields["behav_logprobs"]), torch.zeros_like(logprobs))
            zero = torch.zeros((), device=logprobs.device)
            sums = torch.stack([
                loss.detach().float(), tokens.float(), kl.detach().sum(),
                torch.where(mask, entropy, torch.zeros_like(entropy)).sum(),
                loss_stats.get("clip_low_frac", zero) * tokens, loss_stats.get("clip_high_frac", zero) * tokens,
                w.sum(), w.square().sum(),
            ]).to(torch.float64)
        return loss, sums, w.max().to(torch.float64)

    def _num_sequences(self, step: StepBatch) -> int:
        """token_sum_norm divides by the fixed samples_per_step (every token weighs the same whatever the
        batch); seq_mean by the sequences of this step."""
        return self.cfg.samples_per_step if self.cfg.aggregation == "token_sum_norm" else step.num_samples

    def _policy_loss(self, logprobs: Tensor, p: PackedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, f = self.cfg, p.fields
        mask, behav, adv = f["loss_mask"], f["behav_logprobs"], f["advantages"]
        if cfg.policy_loss == "reinforce_is":
            return reinforce_is_loss(logprobs, behav, adv, mask, cfg.is_cap)
        if cfg.policy_loss == "ppo_clip":  # one update per batch: the "old" policy is the behaviour policy
            return ppo_clip_loss(logprobs, behav, adv, mask, cfg.clip_low, cfg.clip_high)
        if cfg.policy_loss == "decoupled_ppo":
            return decoupled_ppo_loss(logprobs, f["prox_logprobs"], behav, adv, mask, cfg.clip_low, cfg.clip_high)
        if cfg.policy_loss == "gspo":
            return gspo_loss(logprobs, behav, adv, mask, cfg.clip_low, cfg.clip_high, seq_ids=p.seq_ids)
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r}")

    def _no_grad_sync_unless(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are all-reduced once, after the last micro-batch (DeepSpeed decides this itself)."""
        if last or self.is_deepspeed:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)

    def _backward(self, loss: Tensor, last: bool) -> None:
        if self.is_deepspeed:  # the engine accumulates until we declare the boundary
            self.model.set_gradient_accumulation_boundary(last)
            self.model.backward(loss)
        else:
            self.accelerator.backward(loss)

    def _reduce(self, sums: Tensor, w_max: Tensor) -> tuple[Tensor, Tensor]:
        if self.accelerator.num_processes > 1:
            dist.all_reduce(sums)
            dist.all_reduce(w_max, op=dist.ReduceOp.MAX)
        return sums, w_max

    def _apply_update(self, loss_finite: bool) -> tuple[bool, float]:
        """Clip, check, step: (applied, pre-clip gradient norm). Nothing changes when it is not applied."""
        if self.is_deepspeed:
            # DeepSpeed clips and steps inside engine.step and skips a step whose gradients overflowed.
            self.model.step()
            grad_norm = self.model.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            applied = bool(self.model.was_step_applied())
            if applied and not loss_finite:
                log.error("DeepSpeed applied a step whose loss was not finite")
            if applied:
                self.scheduler.step()
            return applied, grad_norm
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        if not (loss_finite and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False, grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True, grad_norm

    def _maybe_reset_reference(self) -> bool:
        """ProRL v2: every `ref_reset_every` versions the KL reference becomes the current policy (the
        optimizer state is kept)."""
        if self.ref_model is None or not self.ref_resets.should_reset(self.version):
            return False
        self.reset_reference()
        return True

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Copy the current policy into the reference model."""
        if self.ref_model is None:
            return
        if not (self.is_zero3 or self.is_fsdp):
            reset_reference(self.ref_model, self.unwrapped_model)
            return
        ref_params = dict(self.ref_model.named_parameters())
        for name, t in self.full_parameters(all_ranks=True):
            ref_params[name].copy_(t)

    def _stats(self, step: StepBatch, t: dict[str, float], w_max: float, grad_norm: float, lags: list[int],
               lr: float, applied: bool, ref_reset: bool, micro_batches: int, seconds: float) -> dict[str, float]:
        n = max(t["tokens"], 1.0)
        adv = step.advantages
        return {
            "loss": t["loss"],
            "kl": t["kl"] / n,
            "entropy": t["entropy"] / n,
            "clip_low_frac": t["clip_low"] / n,
            "clip_high_frac": t["clip_high"] / n,
            "is_weight_mean": t["w"] / n,
            "is_weight_max": w_max,
            "ess": t["w"] ** 2 / (n * t["w2"]) if t["w2"] > 0 else 1.0,  # normalised, in [0, 1]
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std(unbiased=False)),
            "grad_norm": grad_norm,
            "lag_mean": sum(lags) / len(lags),
            "lag_max": float(max(lags)),
            "tokens": t["tokens"],
            "samples": float(step.num_samples),
            "micro_batches": float(micro_batches),
            "lr": lr,
            "step_s": seconds,
            "skipped": 0.0 if applied else 1.0,
            "version": float(self.version),
            "ref_reset": 1.0 if ref_reset else 0.0,
        }

    # --- state for checkpoints (see checkpoint.py; model/optimizer/scheduler/RNG go through accelerate) ------

    def state_dict(self) -> dict[str, int]:
        return {"version": self._version, "step": self.step, "ref_last_reset": self.ref_resets.last_reset_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._version = int(state["version"])
        self.step = int(state["step"])
        self.ref_resets.last_reset_step = int(state.get("ref_last_reset", 0))
