"""The trainer: one policy, one AdamW, one optimizer step per batch of scored samples, weights pushed to engines.

accelerate is both the launcher and the wrapper: on a laptop `Accelerator(cpu=True)` leaves the model as it is
(fp32); on GPUs the same code runs under DeepSpeed ZeRO-3 or FSDP from `configs/accelerate/*.yaml` (bf16). The
few places where sharding matters (gathering full parameters, the DeepSpeed backward/step) are marked.

`optimizer_step` reads top to bottom:

    batch -> validate -> split into trainer.ppo_minibatches -> pack this rank's share into micro-batches
          -> no grad: [proximal log-probs (decoupled PPO)] [reference log-probs (KL)] [values (critic)]
          -> advantages (the registered estimator, or GAE from the critic; KL in the reward first if asked)
          -> per minibatch: per micro-batch: log-probs -> policy loss (+ KL) (- entropy bonus) -> aggregate
                            -> backward (accumulate); then clip -> NaN/inf check -> optimizer update
          -> [critic updates] -> scheduler step -> version += 1 -> [reference reset (+ optimizer reset)]

Algorithms are looked up by name in `pipelinerl.rl.registry` (losses and estimators register themselves there), so
this file does not change when one is added.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env, set_seed
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from pipelinerl.config import TrainerConfig, WeightSyncConfig
from pipelinerl.contracts.trainer import BroadcastStats
from pipelinerl.rl import registry
from pipelinerl.rl.kl import KLCoefficient, ReferenceResetPolicy, kl_estimate, kl_to_go, reset_reference
from pipelinerl.rl.losses import aggregate
from pipelinerl.rl.packing import PackedBatch, shared_prompts_are_cheaper
from pipelinerl.rl.registry import LossInputs
from pipelinerl.samples import Sample
from pipelinerl.trainer import update
from pipelinerl.trainer.batch import (
    MicroBatch,
    Minibatch,
    StepBatch,
    build_step,
    filler_micro_batch,
    pad_micro_batches,
    sample_advantages,
    set_sample_advantages,
)
from pipelinerl.trainer.critic import Critic
from pipelinerl.trainer.forward import packed_logprobs, packed_logprobs_and_entropy, resolve_attn_implementation
from pipelinerl.trainer.linear_kernels import choose_shapes, route_linears
from pipelinerl.trainer.optim import build_optimizer, build_scheduler
from pipelinerl.trainer.publisher import WeightPublisher
from pipelinerl.weight_sync import DTYPES, WeightUpdateGroup

log = logging.getLogger(__name__)

# Sums over trained tokens that make up the step's stats (reduced across data-parallel ranks).
_SUM_KEYS = ("loss", "tokens", "kl", "entropy", "clip_low", "clip_high", "clipped", "dual_clip", "behav_capped", "w",
             "w2")


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
        # unset algorithm settings (clip range, aggregation) take the chosen loss's defaults
        self.cfg = (cfg or TrainerConfig()).with_algorithm_defaults()
        self.loss_spec = registry.policy_loss(self.cfg.policy_loss)
        self.adv_spec = registry.advantage(self.cfg.advantage)
        self.loss_settings = registry.settings_for(self.loss_spec, self.cfg)  # what the loss declared it reads
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
        # float32 linear layers through oneDNN where it multiplies faster than torch's BLAS on this CPU
        self.onednn_shapes = self._route_policy(model)
        self.param_names = [name for name, _ in model.named_parameters()]  # tied weights appear once
        optimizer = build_optimizer(model, self.cfg, fused=self.fused_adamw)
        self.scheduler = build_scheduler(optimizer, self.cfg)  # stepped by us, never by accelerate
        self._configure_deepspeed()
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        # How packed rows go through the model (rl/packing.py): flash-attention's varlen kernels where loaded,
        # else right-padded rows or one row under a block-diagonal mask, whichever costs less per micro-batch.
        self._attention = "auto"

        self.ref_model = self._load_reference() if self.cfg.kl_coef > 0 else None
        c = self.cfg
        self.ref_resets = ReferenceResetPolicy(every_n_steps=c.ref_reset_every or None, kl_threshold=c.ref_reset_kl,
                                               patience=c.ref_reset_patience or None)
        self.kl_coef = KLCoefficient(c.kl_coef, c.kl_schedule, c.kl_coef_end, c.kl_schedule_steps, c.kl_target,
                                     c.kl_horizon)
        # PPO with a value model (an advantage estimator with token_level=True, i.e. gae): prepared after the policy
        # so accelerate's checkpoints list the policy first, as older checkpoints have it
        self.critic = (Critic(self.model_path, self.cfg, self.accelerator, self.attn_implementation,
                              self.onednn_shapes, seed, self.fused_adamw)
                       if self.adv_spec.token_level else None)
        # samples with advantage 0 left out of the passes where nothing but the policy loss would see them
        self.skips_zero_advantage = (c.skip_zero_advantage and self.loss_spec.zero_without_advantage
                                     and not self.adv_spec.token_level and self.ref_model is None
                                     and c.entropy_coef == 0)
        # a group's samples share their prompt in a micro-batch where that costs less (rl/packing.py: the same
        # log-probs and gradients, the prompt computed once): it needs the mask (sdpa, eager; flash-attention's
        # varlen kernel cannot say that a completion sees the prompt but not its siblings), and not with the
        # critic, which reads every sequence back whole
        self._share_prompts = (functools.partial(shared_prompts_are_cheaper, config=model.config)
                               if c.share_prompts and self.critic is None
                               and self.attn_implementation in ("sdpa", "eager") else None)
        # the policy before the batch's first update, for a loss that takes its trust region there and for every
        # loss with several updates per batch (LossInputs.prox_logprobs)
        self.needs_proximal = self.loss_spec.needs_proximal or c.ppo_minibatches > 1
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
        ref = ref.to(self.accelerator.device).eval().requires_grad_(False)
        route_linears(ref, self.onednn_shapes)
        return ref

    def _route_policy(self, model: nn.Module) -> set[tuple[int, int]]:
        """Route the policy's linear layers as trainer.linear_kernel chooses (linear_kernels.py); returns the shapes
        routed, for the reference model and the critic. None on a GPU, and none for a sharded model, whose layers
        are multiplied on gathered weights by ZeRO-3's / FSDP's own hooks."""
        if self.accelerator.device.type != "cpu" or self.is_zero3 or self.is_fsdp:
            return set()  # the policy is loaded on the CPU, then moved: decide by where it will train
        start = time.perf_counter()
        shapes = choose_shapes(model, self.cfg.linear_kernel)
        routed = route_linears(model, shapes)
        if routed:
            log.info("trainer.linear_kernel=%s: %d linear layers multiply through oneDNN (%s)%s",
                     self.cfg.linear_kernel, routed, ", ".join(f"{o}x{i}" for o, i in sorted(shapes)),
                     f", timed faster than BLAS on this CPU in {time.perf_counter() - start:.2f} s"
                     if self.cfg.linear_kernel == "auto" else "")
        return shapes

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
    def fused_adamw(self) -> bool:
        """Torch's one-kernel AdamW (see build_optimizer): on CPU, where the parameters are plain tensors."""
        return self.accelerator.device.type == "cpu" and not self.is_deepspeed and not self.is_fsdp

    @property
    def unwrapped_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def version(self) -> int:
        """Weight version of the current parameters: 0 for the initial model, +1 per applied optimizer step."""
        return self._version

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    def any_process(self, *flags: bool) -> list[bool]:
        """For each flag, whether it holds on any trainer process (one small all-reduce when there are several)."""
        if self.accelerator.num_processes == 1:
            return list(flags)
        t = torch.tensor([float(f) for f in flags], device=self.accelerator.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [v > 0 for v in t.tolist()]

    def barrier(self, after: str) -> None:
        """See `ranks.host_barrier`: outside the trainer's collectives, bounded by main_process_timeout_s."""
        from pipelinerl.trainer.ranks import host_barrier

        host_barrier(after)

    # --- state on disk: trainer/checkpoint.py ----------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir: Path, data_position: dict[str, Any]) -> Path:
        from pipelinerl.trainer.checkpoint import save_checkpoint

        return save_checkpoint(self, ckpt_dir, data_position)

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        from pipelinerl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(self, ckpt_dir)

    def export(self, out_dir: Path) -> Path:
        from pipelinerl.trainer.checkpoint import export_hf

        return export_hf(self, out_dir)

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

    def ensure_engines(self, group: WeightUpdateGroup | None, engine_urls: Sequence[str], ranks_per_engine: int = 1,
                       wait_s: float = 600.0, should_stop: Callable[[], bool] = lambda: False, force: bool = False
                       ) -> tuple[WeightUpdateGroup | None, list[str]]:
        """See `WeightPublisher.ensure_engines`: re-form the group when an engine died and came back."""
        return self.publisher.ensure_engines(group, engine_urls, ranks_per_engine, wait_s, should_stop, force)

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
        """One step on a batch of scored samples: `trainer.ppo_minibatches` optimizer updates, one weight version
        (see the module docstring for the flow).

        Raises ValueError naming the sample for a batch it cannot train on. A NaN/inf loss or gradient skips
        that update (weights and optimizer state untouched by it); when every update of the step is skipped the
        version stays, and the stats say `skipped` = 1.
        """
        start = time.perf_counter()
        cfg, acc = self.cfg, self.accelerator
        step = build_step(batch, cfg.micro_batch_tokens, acc.process_index, acc.num_processes, acc.device,
                          cfg.ppo_minibatches, cfg.overlong_filtering,
                          leave_out=self._no_gradient if self.skips_zero_advantage else None,
                          share_prompts=self._share_prompts)
        minibatches = [self._same_count_on_all_ranks(step, m.micro_batches) for m in step.minibatches]
        every_mb = [mb for mbs in minibatches for mb in mbs]
        lags = [s.lag(self.version) for s in step.samples]
        lr, kl_coef = self.lr, self.kl_coef.at_step(self.step)
        self.model.train()

        # before any update, with no gradient: the policies the loss compares against, and the critic's values
        if self.needs_proximal:
            self._add_logprobs(self.model, every_mb, "prox_logprobs", self._attention)
        if self.ref_model is not None:
            self._add_logprobs(self.ref_model, every_mb, "ref_logprobs", "auto")
            self._add_kl(every_mb)
        if self.critic is not None:
            self.critic.add_values(every_mb)
        self._set_advantages(step, every_mb, kl_coef)
        prepared = time.perf_counter()

        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=acc.device)
        first_clip = torch.zeros((), dtype=torch.float64, device=acc.device)
        w_max = torch.zeros((), dtype=torch.float64, device=acc.device)
        grad_norms, applied_updates = [], 0
        loss_stats: dict[str, Tensor] = {}  # the loss's own statistics, token-weighted sums (maxima for *_max)
        # the critic's warm-up (`trainer.critic.policy_frozen_steps`): no policy pass at all, the weights kept
        frozen = self.critic is not None and self.step < cfg.critic.policy_frozen_steps
        for k, (part, mbs) in enumerate([] if frozen else zip(step.minibatches, minibatches)):
            part_sums = torch.zeros_like(sums)
            for i, mb in enumerate(mbs):
                last = i == len(mbs) - 1
                with self._no_grad_sync_unless(last):
                    loss, mb_sums, mb_w_max, mb_stats = self._micro_batch_loss(mb, step, part, kl_coef)
                    # DDP / ZeRO / FSDP average gradients over ranks; each rank's loss already has the whole
                    # minibatch's denominator, so scale back up to get the sum.
                    self._backward(update.poisoned_unless_finite(loss) * acc.num_processes * mb.weight, last)
                for key, value in mb_stats.items():
                    acc_value = loss_stats.setdefault(key, torch.zeros((), dtype=torch.float64, device=acc.device))
                    if mb.weight:
                        loss_stats[key] = torch.maximum(acc_value, value) if key.endswith("_max") else acc_value + value
                if mb.weight:
                    part_sums += mb_sums
                    w_max = torch.maximum(w_max, mb_w_max)
            part_sums = self._all_reduce(part_sums)
            applied, grad_norm = self._apply_update(math.isfinite(float(part_sums[0])))
            if not applied:
                log.warning("step %d, minibatch %d: non-finite loss (%s) or gradient norm (%s); update skipped, "
                            "weights kept", self.step, k, float(part_sums[0]), grad_norm)
            applied_updates += applied
            grad_norms.append(grad_norm)
            sums += part_sums
            if k == 0:
                first_clip = part_sums[_SUM_KEYS.index("clipped")] / part_sums[_SUM_KEYS.index("tokens")].clamp(min=1)
        w_max = self._all_reduce(w_max, dist.ReduceOp.MAX)
        totals = dict(zip(_SUM_KEYS, sums.tolist()))
        loss_means = self._reduce_loss_stats(loss_stats, max(totals["tokens"], 1.0))
        totals["loss"] /= len(minibatches)  # each minibatch's loss is a mean over its own samples or tokens
        passed = time.perf_counter()
        critic_stats = self.critic.update(every_mb, self.step) if self.critic is not None else {}
        critic_done = time.perf_counter()

        applied = applied_updates > 0 or frozen  # a frozen step is a version with the same weights, not a skip
        grad_norms = grad_norms or [0.0]
        self.step += 1
        ref_reset = False
        if applied:
            with warnings.catch_warnings():  # a frozen step steps the schedule before any optimizer update
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
                self.scheduler.step()  # the learning-rate schedule counts steps (batches), not minibatch updates
            self._version += 1
            self.kl_coef.update(totals["kl"] / max(totals["tokens"], 1.0), step.num_samples)
            ref_reset = self._maybe_reset_reference(totals["kl"] / max(totals["tokens"], 1.0))
        # the loss's statistics first: the trainer's own (IS weights and ESS over the whole step) take precedence
        stats = loss_means | self._stats(step, totals, float(w_max), grad_norms, lags, lr, applied, ref_reset,
                                         every_mb, time.perf_counter() - start)
        stats.update(kl_coef=kl_coef, updates_applied=float(applied_updates), policy_frozen=float(frozen),
                     clip_frac_first_minibatch=float(first_clip),
                     clip_frac_later_minibatches=self._later_clip_frac(totals, float(first_clip), step),
                     **critic_stats)
        # where step_s went, on the host's clock (on a GPU the kernels queued are waited for by the .item()s
        # and .tolist()s along the way, so a part can hold the tail of the part before it): batching and the
        # no-gradient passes (proximal, reference, critic values, advantages); the policy's forward, backward and
        # updates; the critic's updates. bench/step_cost.py reads them.
        stats.update(step_prepare_s=prepared - start, step_policy_s=passed - prepared,
                     step_critic_s=critic_done - passed)
        return stats

    def _reduce_loss_stats(self, loss_stats: dict[str, Tensor], tokens: float) -> dict[str, float]:
        """The loss's statistics over the step, on all ranks: token-weighted means, `*_max` ones the maximum. Every
        rank ran as many micro-batches of the same loss, so every rank has the same keys."""
        keys = sorted(loss_stats)
        means = [k for k in keys if not k.endswith("_max")]
        maxes = [k for k in keys if k.endswith("_max")]
        out = {}
        if means:
            summed = self._all_reduce(torch.stack([loss_stats[k] for k in means]))
            out.update({k: float(v) / tokens for k, v in zip(means, summed.tolist())})
        if maxes:
            top = self._all_reduce(torch.stack([loss_stats[k] for k in maxes]), dist.ReduceOp.MAX)
            out.update(dict(zip(maxes, top.tolist())))
        return out

    def _no_gradient(self, step: StepBatch) -> Tensor:
        """[N] bool: the samples whose every token has loss and gradient 0 (advantage 0, or no token trained on)."""
        return (sample_advantages(step, self.cfg) == 0) | (step.trained_tokens == 0)

    def _later_clip_frac(self, totals: dict[str, float], first: float, step: StepBatch) -> float:
        """Clipped fraction of the tokens of the minibatches after the first (0 with one minibatch)."""
        first_tokens = step.minibatches[0].num_tokens
        later_tokens = totals["tokens"] - first_tokens
        if later_tokens <= 0:
            return 0.0
        return (totals["clipped"] - first * first_tokens) / later_tokens

    def _same_count_on_all_ranks(self, step: StepBatch, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Pad this rank's micro-batches of one minibatch with zero-weight ones so every rank runs as many passes
        (sharded models gather parameters collectively in every forward and backward)."""
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

    @torch.no_grad()
    def _add_kl(self, micro_batches: list[MicroBatch]) -> None:
        """The behaviour policy's KL to the reference per token (`kl_behav`), from the engine's log-probs: what the
        KL-in-reward penalty charges. OpenRLHF and verl take the actor's log-probs recomputed before training, which
        are the engine's up to its numerics on a fresh sample; a stale one is charged the KL of the policy that
        sampled it."""
        for mb in micro_batches:
            f = mb.packed.fields
            kl = kl_estimate(f["behav_logprobs"], f["ref_logprobs"], self.cfg.kl_estimator)
            f["kl_behav"] = torch.where(f["loss_mask"], kl, torch.zeros_like(kl))

    def _set_advantages(self, step: StepBatch, micro_batches: list[MicroBatch], kl_coef: float) -> None:
        """Every token's advantage: the registered per-sample estimator over the step's rewards (less the KL
        penalty with `trainer.kl_in_reward`), or GAE from the critic's values."""
        cfg = self.cfg
        rewards = step.rewards.to(torch.float64)
        kl_sums = None
        if cfg.kl_in_reward:
            kl_sums = self._per_sample_sums(step, micro_batches, "kl_behav")
            step.extra["kl_penalty_mean"] = float(kl_coef * kl_sums.mean())
        if self.adv_spec.token_level:
            step.extra.update(self.critic.set_gae_advantages(step, micro_batches,
                                                             kl_coef if cfg.kl_in_reward else 0.0))
            # per-sample stats (adv_mean, adv_std) take each sample's mean advantage over its trained tokens
            sums = self._per_sample_sums(step, micro_batches, "advantages")
            step.advantages = (sums / step.trained_tokens.to(sums).clamp(min=1)).to(torch.float32)
            return
        if kl_sums is not None and cfg.kl_reward == "to_go":
            self._set_kl_to_go_advantages(step, micro_batches, kl_coef)
            return
        if kl_sums is not None:
            rewards = rewards - kl_coef * kl_sums
        step.advantages = sample_advantages(step, cfg, rewards.to(torch.float32))
        set_sample_advantages(micro_batches, step.advantages)

    def _set_kl_to_go_advantages(self, step: StepBatch, micro_batches: list[MicroBatch], kl_coef: float) -> None:
        """`trainer.kl_reward: to_go` (OpenRLHF's REINFORCE++): each token's advantage is its sample's (from the
        rewards alone) minus `kl_coef` times its KL reward-to-go, then, for a whitened estimator, normalised over
        the step's trained tokens on all ranks."""
        centred = sample_advantages(step, self.cfg, step.rewards.to(torch.float32), whitened=False)
        set_sample_advantages(micro_batches, centred)
        sums = torch.zeros(3, dtype=torch.float64, device=self.accelerator.device)
        for mb in micro_batches:
            f = mb.packed.fields
            f["advantages"] = f["advantages"] - kl_coef * kl_to_go(f["kl_behav"], f["loss_mask"], mb.packed.seq_ids)
            if mb.weight:
                adv = f["advantages"][f["loss_mask"]].double()
                sums += torch.stack([adv.new_tensor(float(adv.numel())), adv.sum(), adv.square().sum()])
        if self.adv_spec.whitened:
            n, total, squares = self._all_reduce(sums).tolist()
            mean = total / max(n, 1.0)
            std = math.sqrt(max(squares / max(n, 1.0) - mean * mean, 0.0))
            for mb in micro_batches:
                f = mb.packed.fields
                whitened = (f["advantages"] - mean) / (std + 1e-6)
                f["advantages"] = torch.where(f["loss_mask"], whitened, torch.zeros_like(whitened))
        # per-sample stats (adv_mean, adv_std) take each sample's mean advantage over its trained tokens
        per_sample = self._per_sample_sums(step, micro_batches, "advantages")
        step.advantages = (per_sample / step.trained_tokens.to(per_sample).clamp(min=1)).to(torch.float32)

    def _per_sample_sums(self, step: StepBatch, micro_batches: list[MicroBatch], field: str) -> Tensor:
        """Each sample's sum of a per-token field over the whole step ([N], float64, the same on every rank)."""
        out = torch.zeros(step.num_samples, dtype=torch.float64, device=self.accelerator.device)
        for mb in micro_batches:
            if not mb.weight:
                continue
            p = mb.packed
            per_seq = torch.zeros(p.num_sequences, dtype=torch.float64, device=out.device)
            per_seq.index_add_(0, p.seq_ids.to(out.device), p.fields[field].to(torch.float64))
            out.index_add_(0, torch.tensor(mb.sample_indices, device=out.device), per_seq)
        if self.accelerator.num_processes > 1:
            dist.all_reduce(out)
        return out.cpu()

    def _micro_batch_loss(self, mb: MicroBatch, step: StepBatch, part: Minibatch, kl_coef: float
                                  ) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """The micro-batch's share of its minibatch's loss, plus its stat sums (in `_SUM_KEYS` order), max IS
        weight, and the loss's own statistics weighted by its trained tokens (`*_max` ones unweighted)."""
        cfg, p = self.cfg, mb.packed
        mask = p.fields["loss_mask"]
        # the LM head runs in chunks (no [tokens, vocab] logits); the entropy comes from the same chunks, with a
        # gradient only when it is a bonus in the loss
        logprobs, entropy = packed_logprobs_and_entropy(self.model, p, cfg.temperature, self._attention,
                                                        cfg.logprob_chunk_tokens, entropy_grad=cfg.entropy_coef > 0)
        per_token, loss_stats = self._policy_loss(logprobs, p)
        kl = torch.zeros_like(logprobs)
        if self.ref_model is not None:
            kl = torch.where(mask, kl_estimate(logprobs, p.fields["ref_logprobs"], cfg.kl_estimator), kl)
            if not cfg.kl_in_reward:
                per_token = per_token + kl_coef * kl
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * torch.where(mask, entropy, torch.zeros_like(entropy))
        loss = aggregate(per_token, mask, cfg.aggregation, num_sequences=self._num_sequences(part),
                         seq_ids=p.seq_ids, num_tokens=part.num_tokens)

        with torch.no_grad():
            tokens = mask.sum()
            w = torch.where(mask, torch.exp(logprobs - p.fields["behav_logprobs"]), torch.zeros_like(logprobs))
            zero = torch.zeros((), device=logprobs.device)
            clip_low, clip_high = loss_stats.get("clip_low_frac", zero), loss_stats.get("clip_high_frac", zero)
            dual = loss_stats.get("dual_clip_frac", zero)
            sums = torch.stack([
                loss.detach().float(), tokens.float(), kl.detach().sum(),
                torch.where(mask, entropy.detach(), torch.zeros_like(entropy)).sum(),
                clip_low * tokens, clip_high * tokens, (clip_low + clip_high) * tokens, dual * tokens,
                loss_stats.get("behav_capped_frac", zero) * tokens, w.sum(), w.square().sum(),
            ]).to(torch.float64)
            # every statistic the loss returns, token-weighted (a `*_max` one as it is, reduced by max)
            weighted = {k: (v.detach().double() if k.endswith("_max") else v.detach().double() * tokens)
                        for k, v in loss_stats.items()}
        return loss, sums, w.max().to(torch.float64), weighted

    def _num_sequences(self, part: Minibatch) -> float:
        """token_sum_norm and seq_mean divide by the samples of the minibatch actually trained (all ranks, those left
        out of the passes for want of a gradient included), which the trainer contract lets differ from
        trainer.samples_per_step / ppo_minibatches."""
        return part.num_samples

    def _policy_loss(self, logprobs: Tensor, p: PackedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The registered loss `trainer.policy_loss` (pipelinerl/rl/registry.py), called as every loss is."""
        f = p.fields
        prox = f.get("prox_logprobs")
        inputs = LossInputs(mask=f["loss_mask"], advantages=f["advantages"], behav_logprobs=f["behav_logprobs"],
                            old_logprobs=prox if self.loss_spec.needs_proximal else f["behav_logprobs"],
                            prox_logprobs=prox, seq_ids=p.seq_ids)
        return self.loss_spec.fn(logprobs, inputs, self.loss_settings)

    def _no_grad_sync_unless(self, last: bool) -> contextlib.AbstractContextManager:
        return update.no_grad_sync_unless(self.accelerator, self.model, last)

    def _backward(self, loss: Tensor, last: bool) -> None:
        update.backward(self.accelerator, self.model, loss, last)

    def _all_reduce(self, t: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        if self.accelerator.num_processes > 1:
            dist.all_reduce(t, op=op)
        return t

    def _apply_update(self, loss_finite: bool) -> tuple[bool, float]:
        """Clip, check, step the optimizer (the scheduler steps once per batch, in `optimizer_step`): (applied,
        pre-clip gradient norm). Nothing changes when it is not applied."""
        applied, grad_norm = update.apply_update(self.accelerator, self.model, self.optimizer, self.cfg.grad_clip,
                                                 loss_finite)
        if applied and not loss_finite:  # (poisoned_unless_finite makes this impossible: say so loudly if not)
            log.error("an update whose loss was not finite was applied")
        return applied, grad_norm

    def _maybe_reset_reference(self, kl: float) -> bool:
        """ProRL: the KL reference becomes the current policy every `ref_reset_every` versions, when the step's KL
        exceeds `ref_reset_kl`, or after `ref_reset_patience` held-out evaluations without a new best
        (`note_eval_score`); with `ref_reset_optimizer` the optimizer's moments are reset too."""
        if self.ref_model is None:
            return False
        stagnating = None
        if self.accelerator.num_processes > 1:  # only the main process evaluates: every rank must decide alike
            flag = torch.tensor(float(self.ref_resets.stagnating), device=self.accelerator.device)
            stagnating = bool(self._all_reduce(flag, dist.ReduceOp.MAX))
        if not self.ref_resets.should_reset(self.version, kl, stagnating):
            return False
        self.reset_reference()
        if self.cfg.ref_reset_optimizer:
            reset_optimizer_state(self.optimizer)
        return True

    def note_eval_score(self, score: float) -> None:
        """A held-out score (higher is better), for the reference reset on a stagnating validation score."""
        self.ref_resets.note_score(score)

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

    def _stats(self, step: StepBatch, t: dict[str, float], w_max: float, grad_norms: list[float], lags: list[int],
               lr: float, applied: bool, ref_reset: bool, micro_batches: list[MicroBatch], seconds: float
               ) -> dict[str, float]:
        n = max(t["tokens"], 1.0)
        adv = step.advantages
        return {
            "loss": t["loss"],
            "kl": t["kl"] / n,
            "entropy": t["entropy"] / n,
            "clip_low_frac": t["clip_low"] / n,
            "clip_high_frac": t["clip_high"] / n,
            "dual_clip_frac": t["dual_clip"] / n,
            "behav_capped_frac": t["behav_capped"] / n,
            "is_weight_mean": t["w"] / n,
            "is_weight_max": w_max,
            "ess": t["w"] ** 2 / (n * t["w2"]) if t["w2"] > 0 else 1.0,  # normalised, in [0, 1]
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std(unbiased=False)),
            "grad_norm": grad_norms[-1],
            "grad_norm_max": max(grad_norms),
            "lag_mean": sum(lags) / len(lags),
            "lag_max": float(max(lags)),
            "tokens": t["tokens"],
            "samples": float(step.num_samples),
            "overlong_filtered": float(step.filtered),
            # left out of the forward and backward passes (trainer.skip_zero_advantage): they add no gradient
            "samples_left_out": float(step.left_out),
            "tokens_left_out": float(step.left_out_tokens),
            "micro_batches": float(len(micro_batches)),
            # tokens through the model on this rank (prompts and answers; a shared prompt once): against `tokens`,
            # what packing and trainer.share_prompts saved
            "model_tokens": float(sum(mb.num_tokens for mb in micro_batches if mb.weight)),
            "lr": lr,
            "step_s": seconds,
            "skipped": 0.0 if applied else 1.0,
            "version": float(self.version),
            "ref_reset": 1.0 if ref_reset else 0.0,
            **step.extra,
        }

    # --- state for checkpoints (see checkpoint.py; model/optimizer/scheduler/RNG go through accelerate) ------

    def state_dict(self) -> dict[str, Any]:
        r = self.ref_resets
        return {"version": self._version, "step": self.step, "ref_last_reset": r.last_reset_step,
                "ref_best_score": r.best_score, "ref_evals_without_improvement": r.evals_without_improvement,
                "kl_coef": self.kl_coef.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._version = int(state["version"])
        self.step = int(state["step"])
        self.ref_resets.last_reset_step = int(state.get("ref_last_reset", 0))
        self.ref_resets.best_score = float(state.get("ref_best_score", float("-inf")))
        self.ref_resets.evals_without_improvement = int(state.get("ref_evals_without_improvement", 0))
        self.kl_coef.value = float(state.get("kl_coef", self.kl_coef.value))


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero the optimizer's moments and step counts in place (ProRL v1's reset with the reference): AdamW then
    starts afresh, bias correction included. The state lives in the innermost torch optimizer: accelerate wraps it
    once (`AcceleratedOptimizer.optimizer`), DeepSpeed ZeRO once more (its ZeRO optimizer's `.optimizer` holds the
    fp32 partitions' state)."""
    inner = optimizer
    while getattr(inner, "optimizer", inner) is not inner:
        inner = inner.optimizer
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()
