"""`pipelinerl plan RECIPE --time`: how long one RL step and the whole run will take, and what it will cost,
worked out from the recipe, its plan (placement, KV room, sharding) and the accelerator's published figures. A
roofline model, not a measurement: every figure below comes from bytes moved and FLOPs done at a stated fraction of
the hardware's peak, and every guess it needs is an `Assumptions` field the output names.

One RL step, per part (N = parameters, P = mean prompt tokens, A = mean answer tokens, B = trainer.samples_per_step):
- Decode: each engine decodes r sequences at once (the least of engine.max_running_seqs, what its KV cache holds at
  P + A/2 tokens a sequence, actor.concurrency rounded to whole groups, and the work there is). One decode step
  reads the weights once plus the running sequences' KV cache, and does 2N FLOPs (plus attention) per sequence: its
  time is the larger of bytes / (HBM bandwidth x MBU) and FLOPs / (peak x MFU), over the engine's GPUs. An engine's
  share of a step's answers takes (B / engines) x A / r decode steps. Synchronous (actor.max_lag 0), the step also
  waits for its longest answer: sampling.max_new_tokens decode steps of one sequence at least.
- Prefill: 2N FLOPs (plus attention) per prompt token, compute-bound.
- Training: 6N FLOPs per token (forward and backward), 8N with gradient checkpointing (the forward recomputed),
  for the policy; a forward more for a KL reference (trainer.kl_coef > 0) and for the proximal policy
  (decoupled PPO, trainer.ppo_minibatches > 1); with a critic (trainer.advantage gae) its values' forward and one
  training pass over the batch (trainer.critic.updates split the batch, they do not repeat it). N counts the matrix
  multiplies only: the input embedding is a lookup, the critic has no LM head.
- Weight broadcast: the weights in the engines' dtype from trainer rank 0 to every engine GPU over NVLink (engines on
  rank 0's node) or InfiniBand (across nodes), at LINK_EFFICIENCY of the link; ZeRO-3 / FSDP first gather each
  bucket over the trainer's own links, pipelined with the sending (`weight_sync.PIPELINE_DEPTH`), so the slower
  of the two counts.
- The step: pipelined (actor.max_lag > 0) generation and training overlap, max(generate, train) + broadcast;
  synchronous, or with the engines on the trainer's GPUs, they add up.

Not counted: held-out evaluations (trainer.eval_every), checkpoints, the engines' start, tensor parallelism's
all-reduces, vLLM's scheduling overhead, groups dynamic sampling drops (regenerated), and samples without advantage
that the trainer skips (trainer.skip_zero_advantage): the training time is an upper bound where those apply.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.config import ConfigError, RunConfig
from pipelinerl.plan.fit import Plan
from pipelinerl.plan.memory import _precision
from pipelinerl.plan.shapes import ModelShape
from pipelinerl.plan.units import DTYPE_BYTES

GB = 1e9  # vendors' GB/s and TB/s are decimal


@dataclass(frozen=True)
class Accelerator:
    """One device's published peak figures (a CPU core's measured ones for "cpu")."""

    name: str
    memory_bytes_per_s: float  # HBM bandwidth of one GPU (a core's copy bandwidth on CPU)
    flops: float  # dense bf16 tensor-core FLOP/s of one GPU (a core's fp32 matmul FLOP/s on CPU)
    nvlink_bytes_per_s: float  # NVLink of one GPU, one direction (the datasheets give both directions together)
    network_bytes_per_s: float  # InfiniBand of one node, one direction, all its NICs together
    memory_gb: float  # memory of one GPU, to pick the default for a recipe's resources.gpu_memory_gib
    source: str
    default_mfu: float = 0.4  # model-FLOPs utilisation of training and prefill, of `flops`
    default_mbu: float = 0.7  # fraction of `memory_bytes_per_s` a decode step reaches
    unit: str = "GPU"  # what the run is billed by


# The vendors' spec sheets (dense figures: the datasheets' "with sparsity" bf16 numbers are twice these):
# - H100 SXM: 80 GB HBM3 at 3.35 TB/s, bf16 989 TFLOPS dense (1,979 with sparsity), NVLink 900 GB/s
#   (NVIDIA H100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h100). A DGX H100 / H200 node has eight
#   single-port ConnectX-7 at up to 400 Gb/s (docs.nvidia.com, DGX BasePOD reference architecture, "Core
#   Components"): 8 x 50 GB/s = 400 GB/s a node.
# - H200 SXM: the same GH100 compute (989 TFLOPS dense bf16), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (NVIDIA
#   H200 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h200); the same node networking as DGX H100.
# - A100 80GB SXM: 2,039 GB/s HBM2e, bf16 312 TFLOPS dense (624 with sparsity), NVLink 600 GB/s (NVIDIA A100
#   Tensor Core GPU datasheet, nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); a DGX A100 has eight
#   single-port ConnectX-6 HDR at 200 Gb/s: 8 x 25 GB/s = 200 GB/s a node.
# NVLink's figure counts both directions; a broadcast or an all-gather receives over one, hence the halves below.
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM", 3.35e3 * GB, 989e12, 450 * GB, 400 * GB, 80,
                        "NVIDIA H100 SXM datasheet: 3.35 TB/s, 989 TFLOPS bf16 dense, NVLink 900 GB/s; 8x400 Gb/s IB"),
    "h200": Accelerator("H200 SXM", 4.8e3 * GB, 989e12, 450 * GB, 400 * GB, 141,
                        "NVIDIA H200 SXM datasheet: 4.8 TB/s, 989 TFLOPS bf16 dense, NVLink 900 GB/s; 8x400 Gb/s IB"),
    "a100": Accelerator("A100 80GB SXM", 2.039e3 * GB, 312e12, 300 * GB, 200 * GB, 80,
                        "NVIDIA A100 80GB datasheet: 2,039 GB/s, 312 TFLOPS bf16 dense, NVLink 600 GB/s; 8x200 Gb/s"),
}
GPU_KINDS = (*ACCELERATORS, "cpu")

# NCCL's broadcasts and all-gathers reach about this fraction of a link's peak (an assumption, not a measured figure)
LINK_EFFICIENCY = 0.7
# A CPU run's weight updates go over gloo on loopback TCP, not a memory copy: the bench's measured 680-720 MiB/s
# (docs/benchmarks.md, `engine_updates`, on a Xeon) stands for it
CPU_UPDATE_BYTES_PER_S = 700 * 2**20
DEFAULT_ANSWER_FRACTION = 0.5  # of sampling.max_new_tokens, without --mean-answer-tokens
DEFAULT_PROMPT_TOKENS = 256  # ORZ's template with a problem is about this long; capped at half the prompt room
PROBE_SECONDS = 1.0  # the CPU probe's time, the matmul and the copy half each


def probe_cpu(seconds: float = PROBE_SECONDS) -> Accelerator:
    """This machine's figures for one core: a single-threaded fp32 matmul's FLOP/s and a large copy's bytes/s
    (read plus write), each measured for about `seconds` / 2. Per core because a CPU recipe's processes are sized
    in threads (engine.threads, trainer.threads). A loaded machine measures less: the forecast is for it as it is."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 384
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up: allocation and the kernel's first call
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            torch.mm(a, b)
            done += 1
        flops = 2 * n**3 * done / (time.perf_counter() - start)
        src = torch.empty(16 * 2**20 // 4)  # 16 MiB: past the caches of most CPUs
        dst = torch.empty_like(src)
        dst.copy_(src)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            dst.copy_(src)
            done += 1
        copy = 2 * src.numel() * 4 * done / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return Accelerator("CPU core (measured here)", copy, flops, CPU_UPDATE_BYTES_PER_S, CPU_UPDATE_BYTES_PER_S, 0,
                       f"probe: fp32 matmul {flops / 1e9:.1f} GFLOP/s and copy {copy / GB:.1f} GB/s on one thread",
                       default_mfu=0.5, default_mbu=1.0, unit="core")


def default_gpu(cfg: RunConfig) -> str:
    """h100, unless the recipe's GPUs have more memory than an H100: then the first of the table that has as much
    (resources.gpu_memory_gib 141: h200). A CPU recipe: cpu."""
    if cfg.resources.gpus_per_node == 0:
        return "cpu"
    need = cfg.resources.gpu_memory_gib
    if need <= ACCELERATORS["h100"].memory_gb:
        return "h100"
    return next((k for k, acc in ACCELERATORS.items() if acc.memory_gb >= need), "h100")


def accelerator(kind: str) -> Accelerator:
    """The table's entry, or this machine's probe for "cpu". Raises ConfigError naming --gpu."""
    if kind == "cpu":
        return probe_cpu()
    if kind not in ACCELERATORS:
        raise ConfigError(f"--gpu: must be one of {', '.join(GPU_KINDS)}, got {kind!r}")
    return ACCELERATORS[kind]


@dataclass(frozen=True)
class Assumptions:
    """What the forecast cannot know from the recipe, each with where it came from."""

    mean_answer_tokens: int
    mean_prompt_tokens: int
    mfu: float
    mbu: float
    link_efficiency: float = LINK_EFFICIENCY
    usd_per_device_hour: float | None = None
    answer_source: str = ""
    prompt_source: str = ""


def assumptions(cfg: RunConfig, acc: Accelerator, mean_answer_tokens: int | None = None,
                mean_prompt_tokens: int | None = None, mfu: float | None = None, mbu: float | None = None,
                usd_per_device_hour: float | None = None) -> Assumptions:
    """The defaults for what is not given; raises ConfigError naming the flag of a bad value."""
    s, e = cfg.sampling, cfg.engine
    if mean_answer_tokens is None:
        answer = max(1, round(DEFAULT_ANSWER_FRACTION * s.max_new_tokens))
        answer_source = f"default: {DEFAULT_ANSWER_FRACTION:g} x sampling.max_new_tokens {s.max_new_tokens}"
    elif not 1 <= mean_answer_tokens <= s.max_new_tokens:
        raise ConfigError(f"--mean-answer-tokens: must be in [1, sampling.max_new_tokens {s.max_new_tokens}], "
                          f"got {mean_answer_tokens}")
    else:
        answer, answer_source = mean_answer_tokens, "--mean-answer-tokens"
    room = e.max_model_len - s.max_new_tokens
    if mean_prompt_tokens is None:
        prompt = max(1, min(DEFAULT_PROMPT_TOKENS, room // 2))
        prompt_source = f"default: {DEFAULT_PROMPT_TOKENS}, at most half the {room}-token prompt room"
    elif not 1 <= mean_prompt_tokens <= room:
        raise ConfigError(f"--mean-prompt-tokens: must be in [1, engine.max_model_len - sampling.max_new_tokens = "
                          f"{room}], got {mean_prompt_tokens}")
    else:
        prompt, prompt_source = mean_prompt_tokens, "--mean-prompt-tokens"
    for flag, value in (("--mfu", mfu), ("--mbu", mbu)):
        if value is not None and not 0 < value <= 1:
            raise ConfigError(f"{flag}: must be in (0, 1], got {value:g}")
    if usd_per_device_hour is not None and usd_per_device_hour < 0:
        raise ConfigError(f"--usd-per-gpu-hour: must be >= 0, got {usd_per_device_hour:g}")
    return Assumptions(answer, prompt, acc.default_mfu if mfu is None else mfu, acc.default_mbu if mbu is None else mbu,
                       usd_per_device_hour=usd_per_device_hour, answer_source=answer_source,
                       prompt_source=prompt_source)


@dataclass(frozen=True)
class Forecast:
    accelerator: Accelerator
    assumptions: Assumptions
    engines: int
    devices_per_engine: int  # GPUs (tensor parallel), or cores (engine.threads) on CPU
    trainer_devices: int
    devices: int  # what the run holds and is billed for: every GPU of the cluster, or the cores the processes use
    samples_per_step: int
    steps: int
    running_per_engine: int  # sequences each engine decodes at once
    running_bound: str  # what bounds it
    decode_step_s: float  # one decode step of `running_per_engine` sequences
    decode_memory_bound: bool
    decode_step_bytes: float
    prefill_s: float
    decode_s: float
    longest_answer_s: float  # a sampling.max_new_tokens answer on its own (what a synchronous step waits for)
    generate_s: float
    train_parts: tuple[tuple[str, str, float], ...]  # (what, how, FLOPs)
    train_s: float
    gather_s: float
    send_s: float
    broadcast_s: float
    update_bytes: float
    link: str
    pipelined: bool
    colocated: bool
    step_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def generated_tokens_per_s(self) -> float:
        return self.samples_per_step * self.assumptions.mean_answer_tokens / self.step_s

    @property
    def train_flops(self) -> float:
        return sum(f for _, _, f in self.train_parts)

    @property
    def run_s(self) -> float:
        return self.steps * self.step_s

    @property
    def device_hours(self) -> float:
        return self.run_s / 3600 * self.devices

    @property
    def cost_usd(self) -> float | None:
        rate = self.assumptions.usd_per_device_hour
        return None if rate is None else rate * self.device_hours

    @property
    def bottleneck(self) -> str:
        return "generation" if self.generate_s >= self.train_s else "training"


def matmul_params(shape: ModelShape) -> int:
    """Parameters that take part in a matrix multiply per token: all but the input embedding, a lookup (tied, the
    same matrix is the LM head's, a multiply)."""
    return shape.num_params - (0 if shape.tie_word_embeddings else shape.embedding_params)


def critic_matmul_params(shape: ModelShape) -> int:
    """The value model's: the decoder layers (its head is one column, its embedding a lookup)."""
    return shape.num_layers * shape.layer_params + shape.hidden_size


def attention_flops_per_token(shape: ModelShape, context: float) -> float:
    """Forward FLOPs of one token's attention over `context` earlier tokens: QK^T and AV, 2 FLOPs a multiply-add
    each, in every layer."""
    return 4 * shape.num_layers * shape.num_heads * shape.head_dim * context


def decode_step(shape: ModelShape, cfg: RunConfig, acc: Accelerator, a: Assumptions, devices: int, running: int,
                context: float, kv_bytes_per_token: int) -> tuple[float, bool, float]:
    """(seconds, memory-bound, bytes read) of one decode step of `running` sequences of `context` tokens each on
    an engine of `devices` devices."""
    weights = shape.num_params * DTYPE_BYTES[cfg.model.dtype]
    read = weights + running * context * kv_bytes_per_token
    memory_s = read / (devices * acc.memory_bytes_per_s * a.mbu)
    flops = running * (2 * matmul_params(shape) + attention_flops_per_token(shape, context))
    compute_s = flops / (devices * acc.flops * a.mfu)
    return max(memory_s, compute_s), memory_s >= compute_s, read


def _critic_trained(cfg: RunConfig) -> bool:
    from pipelinerl.rl import registry  # imports torch, as the plan's own memory rules do

    return registry.advantage(cfg.trainer.advantage).token_level


def _needs_proximal(cfg: RunConfig) -> bool:
    from pipelinerl.rl import registry

    return registry.policy_loss(cfg.trainer.policy_loss).needs_proximal or cfg.trainer.ppo_minibatches > 1


def train_parts(cfg: RunConfig, plan: Plan, prompt: int, answer: int) -> tuple[tuple[str, str, float], ...]:
    """The trainer's FLOPs per step, part by part: (what, how, FLOPs)."""
    shape, t = plan.shape, cfg.trainer
    length = prompt + answer
    tokens = t.samples_per_step * length
    attention = attention_flops_per_token(shape, length / 2)  # causal: a token attends to half the sample on average
    checkpointing = plan.trainer_main.checkpointing
    passes = 4 if checkpointing else 3  # forward, backward (twice the forward), and the recomputed forward
    how = "forward, backward" + (", recomputed forward" if checkpointing else "")
    policy = tokens * (2 * matmul_params(shape) + attention)
    parts = [("policy training", how, passes * policy)]
    if t.kl_coef > 0:
        parts.append(("KL reference", "forward (trainer.kl_coef > 0)", policy))
    if _needs_proximal(cfg):
        parts.append(("proximal policy", "forward, before the first update", policy))
    if _critic_trained(cfg):
        critic = tokens * (2 * critic_matmul_params(shape) + attention)
        parts.append(("critic values", "forward", critic))
        parts.append(("critic training", f"{how}: {t.critic.updates} updates, one pass", passes * critic))
    return tuple(parts)


def _update_link(cfg: RunConfig, plan: Plan, acc: Accelerator) -> tuple[float, str]:
    """(bytes/s, in words) of the path from trainer rank 0 to every engine GPU."""
    if not plan.on_gpu or cfg.weight_sync.backend == "gloo":  # colocated engines take gloo too (resolve_for_machine)
        return CPU_UPDATE_BYTES_PER_S, "gloo through host memory and TCP (the bench's measured rate)"
    remote = [n.node.rank for n in plan.nodes if n.engines and n.node.rank != 0]
    if not remote:
        return acc.nvlink_bytes_per_s, "NVLink (every engine on rank 0's node)"
    return (min(acc.nvlink_bytes_per_s, acc.network_bytes_per_s),
            f"InfiniBand (engines on node{'s' if len(remote) > 1 else ''} "
            f"{', '.join(map(str, remote))})")


def _gather_s(cfg: RunConfig, plan: Plan, acc: Accelerator, a: Assumptions) -> float:
    """ZeRO-3 / FSDP: each bucket gathered from the trainer's ranks before it is sent."""
    sharding, t = plan.sharding, cfg.trainer
    if sharding.kind not in ("zero3", "fsdp") or sharding.ranks < 2:
        return 0.0
    on_gpu = plan.on_gpu
    # DeepSpeed under bf16 holds bf16 parameters; anything else an fp32 model (plan/memory.py's rules)
    pb = 2 if sharding.deepspeed and _precision(cfg, on_gpu) == "bf16" else 4
    gathered = plan.shape.num_params * pb * (sharding.ranks - 1) / sharding.ranks
    if not on_gpu:
        bandwidth = acc.nvlink_bytes_per_s
    elif t.num_nodes > 1:  # each GPU's share of its node's NICs
        bandwidth = min(acc.nvlink_bytes_per_s, acc.network_bytes_per_s / plan.cluster.gpus_per_node)
    else:
        bandwidth = acc.nvlink_bytes_per_s
    return gathered / (bandwidth * (a.link_efficiency if on_gpu else 1.0))


def forecast(cfg: RunConfig, plan: Plan, acc: Accelerator, a: Assumptions) -> Forecast:
    """One RL step of `cfg` as `plan` places it, on `acc`, under `a` (the module docstring gives the rules)."""
    shape, t, e, s = plan.shape, cfg.trainer, cfg.engine, cfg.sampling
    on_gpu = plan.on_gpu
    notes: list[str] = []
    engines = sum(len(n.engines) for n in plan.nodes)
    if engines == 0 or plan.engine is None:
        raise ConfigError("engine.num_engines: the plan places no engine, so there is no generation to forecast")
    per_engine = e.tensor_parallel_size if on_gpu else e.threads
    prompt, answer = a.mean_prompt_tokens, a.mean_answer_tokens
    batch = t.samples_per_step
    pipelined = cfg.actor.max_lag > 0 and not plan.colocated
    if on_gpu and acc.memory_gb < plan.cluster.gpu_memory_gib:
        notes.append(f"the plan is for GPUs of {plan.cluster.gpu_memory_gib:g} GiB, more than an {acc.name}'s "
                     f"{acc.memory_gb:g} GB: its KV room is theirs (--gpu-memory {acc.memory_gb:g} plans it on these)")
    if plan.colocated:
        notes.append("the engines share the trainer's GPUs (engine.colocate_with_trainer): generation and training "
                     "take turns, so their times add up")

    # decode: how many sequences an engine runs at once, and one step of them
    share = math.ceil(batch / engines)
    footprint = prompt + answer / 2  # a running sequence's mean KV over its life
    kv_per_token = plan.engine.kv_bytes_per_token * per_engine if on_gpu else plan.engine.kv_bytes_per_token
    groups = max(1, cfg.actor.concurrency // s.group_size) * s.group_size
    work = share * (cfg.actor.max_lag + 1) if pipelined else share
    bounds = {"engine.max_running_seqs": e.max_running_seqs,
              f"the KV cache ({plan.engine.tokens:,} tokens at {footprint:,.0f} a sequence)":
                  int(plan.engine.tokens // footprint),
              "actor.concurrency (whole groups)": groups,
              "the samples there are to generate": work}
    bound, running = min(bounds.items(), key=lambda kv: kv[1])
    if running < 1:
        notes.append(f"the KV cache holds less than one sequence of {footprint:,.0f} tokens: forecast at one")
        running = 1
    step_s, memory_bound, step_bytes = decode_step(shape, cfg, acc, a, per_engine, running, footprint, kv_per_token)
    decode_s = share * answer / running * step_s
    prefill_flops = share * prompt * (2 * matmul_params(shape) + attention_flops_per_token(shape, prompt / 2))
    prefill_s = prefill_flops / (per_engine * acc.flops * a.mfu)
    longest_context = prompt + s.max_new_tokens / 2
    one_s, _, _ = decode_step(shape, cfg, acc, a, per_engine, 1, longest_context, kv_per_token)
    longest_s = s.max_new_tokens * one_s
    generate_s = prefill_s + decode_s
    if cfg.actor.max_lag == 0 and longest_s > generate_s:  # with a lag, the next batch fills the engines meanwhile
        notes.append(f"synchronous: the step waits for its longest answer, {s.max_new_tokens} tokens decoded at "
                     f"{one_s * 1e3:.1f} ms a token ({longest_s:.1f} s), longer than the batch's throughput time")
        generate_s = longest_s

    # training
    parts = train_parts(cfg, plan, prompt, answer)
    trainer_devices = t.num_processes if on_gpu else t.num_processes * t.threads
    train_s = sum(f for _, _, f in parts) / (trainer_devices * acc.flops * a.mfu)

    # the weight update: gathered (ZeRO-3 / FSDP) and sent bucket by bucket, the two pipelined
    update_bytes = shape.num_params * DTYPE_BYTES[cfg.model.dtype]
    bandwidth, link = _update_link(cfg, plan, acc)
    measured = bandwidth == CPU_UPDATE_BYTES_PER_S  # gloo's rate is a measurement already, not a peak
    send_s = update_bytes / (bandwidth * (1.0 if measured else a.link_efficiency))
    gather_s = _gather_s(cfg, plan, acc, a)
    broadcast_s = max(send_s, gather_s)

    step = (max(generate_s, train_s) if pipelined else generate_s + train_s) + broadcast_s
    if on_gpu:
        devices = plan.cluster.nodes * plan.cluster.gpus_per_node
    else:
        devices = engines * e.threads + trainer_devices + 1  # the actor takes a core
        cores = os.cpu_count() or 1
        if devices > cores:
            notes.append(f"the processes want {devices} cores and this machine has {cores}: they share them, so the "
                         "run is slower than this")
    return Forecast(acc, a, engines, per_engine, trainer_devices, devices, batch, t.max_steps, running, bound,
                    step_s, memory_bound, step_bytes, prefill_s, decode_s, longest_s, generate_s, parts, train_s,
                    gather_s, send_s, broadcast_s, update_bytes, link, pipelined, plan.colocated, step, tuple(notes))


def forecast_to_json(f: Forecast) -> dict[str, Any]:
    a, acc = f.assumptions, f.accelerator
    return {
        "accelerator": {"name": acc.name, "memory_bytes_per_s": acc.memory_bytes_per_s, "flops": acc.flops,
                        "nvlink_bytes_per_s": acc.nvlink_bytes_per_s, "network_bytes_per_s": acc.network_bytes_per_s,
                        "source": acc.source, "unit": acc.unit},
        "assumptions": {"mean_answer_tokens": a.mean_answer_tokens, "mean_answer_source": a.answer_source,
                        "mean_prompt_tokens": a.mean_prompt_tokens, "mean_prompt_source": a.prompt_source,
                        "mfu": a.mfu, "mbu": a.mbu, "link_efficiency": a.link_efficiency,
                        "usd_per_device_hour": a.usd_per_device_hour},
        "engines": f.engines, "devices_per_engine": f.devices_per_engine, "trainer_devices": f.trainer_devices,
        "devices": f.devices, "running_per_engine": f.running_per_engine, "running_bound": f.running_bound,
        "decode_step_s": f.decode_step_s, "decode_memory_bound": f.decode_memory_bound,
        "prefill_s": f.prefill_s, "decode_s": f.decode_s, "longest_answer_s": f.longest_answer_s,
        "generate_s": f.generate_s,
        "train_flops": {what: flops for what, _, flops in f.train_parts}, "train_s": f.train_s,
        "gather_s": f.gather_s, "send_s": f.send_s, "broadcast_s": f.broadcast_s, "update_bytes": f.update_bytes,
        "link": f.link, "pipelined": f.pipelined, "colocated": f.colocated, "step_s": f.step_s,
        "bottleneck": f.bottleneck, "samples_per_s": f.samples_per_s,
        "generated_tokens_per_s": f.generated_tokens_per_s, "steps": f.steps, "run_s": f.run_s,
        "device_hours": f.device_hours, "cost_usd": f.cost_usd, "notes": list(f.notes),
    }
