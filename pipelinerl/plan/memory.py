"""The memory of one trainer rank and of one engine GPU, estimated from the model's shape (`shapes`) and the
trainer's sharding (`sharding`); every figure below is in bytes (GiB = 2**30 bytes), N = parameters, T =
`trainer.micro_batch_tokens`, h = hidden size, i = intermediate size, L = layers, V = vocabulary, n = trainer
processes. The rules follow what the trainer actually does (pipelinerl/trainer/trainer.py):

Trainer state, per rank (16 bytes per parameter in every setting; where they live differs):
- DeepSpeed with bf16: the model is cast to bf16 and AdamW keeps fp32 master weights, so parameters 2 B,
  gradients 2 B (ZeRO accumulates in the model dtype), optimizer 12 B (master 4 + two moments 4 + 4).
- Anything else (single process, DDP, FSDP): the model is loaded in fp32 and bf16 is autocast, so parameters
  4 B, gradients 4 B, optimizer 8 B (two moments). DDP's reducer keeps its own gradient buckets: 4 B more.
- ZeRO-3 and FSDP divide all three by n, ZeRO-2 gradients and optimizer, ZeRO-1 the optimizer; DDP replicates.
- DeepSpeed `offload_optimizer` to cpu moves the optimizer and the fp32 gradient partitions (4 B) to host RAM,
  `offload_param` the parameter partitions; FSDP `fsdp_offload_params` moves parameters, gradients and optimizer.
- A KL reference (`trainer.kl_coef` > 0) is a whole copy in the engines' dtype on every rank.

Working set of a training micro-batch (c = compute dtype bytes: 2 under bf16, 4 otherwise):
- One layer's activations per token: (8h + 3*kv_heads*head_dim + 4i) * c + 16h. The first term is a Llama/Qwen2
  layer's saved tensors (norm inputs/outputs, q/k/v and their rotated copies, attention output, o_proj, and the
  SwiGLU MLP's gate, up, act(gate) and product, 4 [T, i] tensors: why the GPT figure of 34h bytes is too low
  here); 16h is the two RMSNorms' float32 copies. Eager attention also keeps the probabilities, heads * T * c,
  and a float32 softmax copy, heads * T * 4, per token per layer.
- Without gradient checkpointing all L layers' activations are held when the loss's backward starts; with it,
  one hidden state per layer (plus the embedding and final-norm outputs: L + 2 of them, 4 B each when the fp32
  model's residual stream is fp32, else c) and one layer's full activations while it is recomputed.
- Logits: computed `trainer.logprob_chunk_tokens` rows at a time (`trainer.forward.ChunkedHeadLogprobs`), never for
  all T tokens at once: two float32 [chunk, V] buffers in the forward plus the chunk's compute-dtype matmul output,
  one float32 buffer and its gradient in the backward; counted as 12 B per chunk row per vocabulary entry. The
  recomputed layer comes after the logits are freed, so the larger of the two counts.
- The packed-sequence attention mask (sdpa, eager; `auto` on GPU is flash-attention 2, which `make install` puts
  there, and needs none): T^2 bytes, plus its additive copy in the compute dtype.
- Sharded parameters gathered for compute: ZeRO-3, the unit in use and the prefetched one, 2 * max(one layer,
  the V*h embedding) in the parameter dtype; FSDP, the root unit (embedding and LM head) and two layers, in c.

Working set of a weight broadcast (after the step, so the larger of the two working sets counts):
- ZeRO-3 and FSDP2 (`pipelinerl.trainer.publisher`): one unit gathered at a time (a `bucket_mb` bucket, or
  64 MB of tensors when sent per tensor, or the largest tensor alone) in the parameter dtype, on every rank;
  the main rank also packs into two reused buffers of max(bucket_mb, the largest tensor) in the engines' dtype.
- Unsharded: no memory when the parameters already are in the engines' dtype (they are broadcast in place);
  otherwise the two packing buffers (each bucket converted while it is packed).
- A fixed TRAINER_OVERHEAD_GIB per trainer GPU for the CUDA context, NCCL buffers and allocator fragmentation.

Engines (t = `engine.tensor_parallel_size` GPUs each; every figure is per GPU): the engine takes
`engine.gpu_memory_utilization` of each of its GPUs; out of it come its shard of the weights (N * `model.dtype`
bytes / t: vLLM and SGLang split every linear layer, the embedding and the LM head over their workers), an
overhead (ENGINE_OVERHEAD_GIB for the CUDA context and CUDA graphs, one prefill chunk of ENGINE_PREFILL_TOKENS
tokens at (4h + 3i/t) * dtype bytes per token: the MLP's activations are split, the hidden states are not, and the
sampler's float32 logits and log-softmax for `engine.max_running_seqs` sequences, 8 * V bytes each, gathered
whole), and the rest is KV cache at 2 * L * ceil(kv_heads / t) * head_dim * dtype bytes per token (each worker
keeps its own KV heads of every token, a copy of one when there are fewer heads than workers), so an engine holds
as many tokens as one of its GPUs does. With `engine.colocate_with_trainer` the engine's share and the trainer's
memory add up on the same GPU. The trainer's ranks are numbered across its nodes (`trainer.num_nodes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelinerl.config import RunConfig
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.plan.shapes import ModelShape
from pipelinerl.plan.sharding import Sharding
from pipelinerl.plan.units import DTYPE_BYTES, GIB, MIB, _gib

TRAINER_OVERHEAD_GIB = 3.0  # CUDA context (~0.5-1 GiB with NCCL), communicator buffers, allocator fragmentation
ENGINE_OVERHEAD_GIB = 2.0  # CUDA context, CUDA graphs, the weight-update group's NCCL buffers
ENGINE_PREFILL_TOKENS = 8192  # vLLM's and SGLang's default chunked-prefill size on large GPUs
LOGIT_BYTES = 12  # per token per vocabulary entry at the log-softmax backward's peak (see the module docstring)
MIN_SEQUENCES = 8  # fewer full-length sequences in the KV cache than this and an engine crawls
ZERO3_MIN_GATHER = 64 * MIB  # Trainer._zero3_parameters gathers at least this much at a time
PACK_BUFFERS = 2  # weight_sync.PIPELINE_DEPTH: packing buffers of one bucket each on the sending rank


@dataclass(frozen=True)
class Line:
    what: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer rank's device memory (host RAM for a CPU trainer)."""

    state: tuple[Line, ...]  # held for the whole run
    training: tuple[Line, ...]  # one micro-batch's forward and backward
    broadcast: tuple[Line, ...]  # a weight broadcast to the engines
    overhead: int
    host: tuple[Line, ...]  # offloaded state, in host RAM
    checkpointing: bool
    activations_checkpointed: int  # checkpoints plus the larger of the logits and one recomputed layer

    @property
    def state_bytes(self) -> int:
        return sum(x.bytes for x in self.state)

    @property
    def training_bytes(self) -> int:
        return sum(x.bytes for x in self.training)

    @property
    def broadcast_bytes(self) -> int:
        return sum(x.bytes for x in self.broadcast)

    @property
    def host_bytes(self) -> int:
        return sum(x.bytes for x in self.host)

    @property
    def total(self) -> int:
        return self.state_bytes + max(self.training_bytes, self.broadcast_bytes) + self.overhead


def _precision(cfg: RunConfig, on_gpu: bool) -> str:
    mixed = cfg.trainer.mixed_precision
    return ("bf16" if on_gpu else "no") if mixed == "auto" else mixed


def layer_activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, eager: bool) -> int:
    """One decoder layer's saved activations for `tokens` tokens (see the module docstring)."""
    h, i = shape.hidden_size, shape.intermediate_size
    per_token = (8 * h + 3 * shape.num_kv_heads * shape.head_dim + 4 * i) * compute_bytes + 16 * h
    if eager:  # probabilities kept for backward, plus the float32 softmax's copy
        per_token += shape.num_heads * tokens * (compute_bytes + 4)
    return per_token * tokens


def trainer_memory(shape: ModelShape, cfg: RunConfig, sharding: Sharding, main: bool = True,
                   on_gpu: bool = True) -> TrainerMemory:
    """One trainer rank's memory: the main process (rank 0, which broadcasts weights) or any other rank."""
    t = cfg.trainer
    N, n, T = shape.num_params, sharding.ranks, t.micro_batch_tokens
    bf16 = _precision(cfg, on_gpu) == "bf16"
    c = 2 if bf16 else 4
    ds_bf16 = sharding.deepspeed and bf16
    pb = 2 if ds_bf16 else 4  # parameter storage: DeepSpeed casts the model to bf16, others keep fp32 weights
    wb = DTYPE_BYTES[cfg.model.dtype]
    div_p, div_g, div_o = sharding.divides

    def share(total: int, divided: bool) -> int:
        return math.ceil(total / n) if divided else total

    p_label = "bf16" if pb == 2 else "fp32"
    params = Line("parameters", share(N * pb, div_p), f"{p_label}, {pb} B/param" + (f" / {n}" if div_p else ""))
    ddp_buckets = sharding.kind == "ddp" and n > 1
    # gradients in the parameters' dtype: ZeRO accumulates in the model dtype, the others keep fp32 weights
    grads = Line("gradients", share(N * pb * (2 if ddp_buckets else 1), div_g),
                 f"{p_label}, {pb} B/param" + (f" / {n}" if div_g else "")
                 + (", plus DDP's reducer buckets (x2)" if ddp_buckets else ""))
    o_bytes = 12 if ds_bf16 else 8
    optim = Line("optimizer", share(N * o_bytes, div_o),
                 ("fp32 master + 2 AdamW moments, 12 B/param" if o_bytes == 12 else "2 fp32 AdamW moments, 8 B/param")
                 + (f" / {n}" if div_o else ""))
    state: list[Line] = []
    host: list[Line] = []
    # FSDP's fsdp_offload_params sets both flags (detect_sharding): parameters, gradients and optimizer move
    for line, offloaded in ((params, sharding.offload_params), (grads, sharding.offload_optimizer),
                            (optim, sharding.offload_optimizer)):
        if offloaded:
            if line is grads and sharding.deepspeed:  # ZeRO-Offload keeps fp32 gradient partitions for CPU Adam
                line = Line("gradients", share(N * 4, True), f"fp32, 4 B/param / {n}")
            host.append(line)
            state.append(Line(line.what, 0, "offloaded to CPU"))
        else:
            state.append(line)
    if t.kl_coef > 0:
        state.append(Line("KL reference", N * wb, f"whole copy in {cfg.model.dtype} on every rank"))
    from pipelinerl.rl import registry  # imports torch: only once a plan is made, as the config's own check does

    if registry.advantage(t.advantage).token_level:  # PPO with a critic (trainer/critic.py): sharded as the policy
        # the value model is the policy's base with a 1-wide head: no LM head unless it is tied to the embedding
        critic_params = N - (0 if shape.tie_word_embeddings else shape.embedding_params)
        scale = critic_params / N
        kept = sum(line.bytes for line in state[:3])
        moved = sum(line.bytes for line in host)
        state.append(Line("critic", int(kept * scale), "value model: parameters, gradients and optimizer as the "
                                                        "policy's, without the LM head"))
        if moved:
            host.append(Line("critic", int(moved * scale), "the critic's offloaded share, as the policy's"))

    # training working set
    eager = t.attn_implementation == "eager"
    layer = layer_activation_bytes(shape, T, c, eager)
    # hidden states between layers are in the parameters' dtype: an fp32 model's residual stream stays fp32
    checkpoints = (shape.num_layers + 2) * T * shape.hidden_size * pb
    everything = shape.num_layers * layer + 2 * T * shape.hidden_size * pb
    chunk = min(T, t.logprob_chunk_tokens)
    logits = LOGIT_BYTES * chunk * shape.vocab_size
    full, checkpointed = everything + logits, checkpoints + max(layer, logits)
    ckpt = t.gradient_checkpointing or sharding.activation_checkpointing
    training: list[Line] = []
    if ckpt:
        training.append(Line("activations", checkpoints, f"checkpointing on: {shape.num_layers + 2} hidden states x "
                                                         f"{T} tokens (off: {_gib(full)} GiB with logits)"))
        if layer > logits:
            training.append(Line("recomputed layer", layer, f"one layer's activations, larger than the logits "
                                                            f"({_gib(logits)} GiB)"))
        else:
            training.append(Line("logits", logits, f"{LOGIT_BYTES} B x {chunk}-token chunk x {shape.vocab_size} vocab "
                                                   f"(then one recomputed layer, {_gib(layer)} GiB)"))
    else:
        training.append(Line("activations", everything, f"checkpointing off: {shape.num_layers} layers x {T} tokens "
                                                        f"(on: {_gib(checkpointed)} GiB)"))
        training.append(Line("logits", logits, f"{LOGIT_BYTES} B x {chunk}-token chunk x {shape.vocab_size} vocab"))
    if t.attn_implementation in ("sdpa", "eager") or (t.attn_implementation == "auto" and not on_gpu):
        mask_bytes = 1 + (pb if eager else c)
        training.append(Line("attention mask", T * T * mask_bytes, f"packed {T} x {T}, bool + additive copy"))
    if sharding.kind == "zero3":
        training.append(Line("gathered parameters", 2 * max(shape.layer_params, shape.embedding_params) * pb,
                             "ZeRO-3: the unit in use and the prefetched one"))
    elif sharding.kind == "fsdp":
        embeddings = shape.embedding_params * (1 if shape.tie_word_embeddings else 2)
        training.append(Line("gathered parameters", (embeddings + 2 * shape.layer_params) * c,
                             "FSDP: embedding/LM head and two layers"))

    # weight broadcast working set
    bucket = int(cfg.weight_sync.bucket_mb * MIB)
    pack = Line("packing buffers", PACK_BUFFERS * bucket, f"{PACK_BUFFERS} x bucket_mb {cfg.weight_sync.bucket_mb:g}")
    # (publisher.py: gathered one unit at a time, packed into two reused buffers; a tensor above the bucket size
    # is a bucket of its own, so the buffers are sized to the larger of the two)
    largest = max(bucket, shape.largest_tensor * wb)
    pack = Line("packing buffers", PACK_BUFFERS * largest,
                f"{PACK_BUFFERS} x max(bucket_mb {cfg.weight_sync.bucket_mb:g}, the largest tensor)")
    broadcast: list[Line] = []
    if sharding.kind in ("zero3", "fsdp"):
        unit = max(bucket or ZERO3_MIN_GATHER, shape.largest_tensor * wb) // wb * pb
        broadcast.append(Line("gathered unit", unit, "one bucket (or 64 MB of tensors) gathered at a time"))
        if main:
            broadcast.append(pack)
    elif main and pb != wb:
        broadcast.append(pack)
    return TrainerMemory(tuple(state), tuple(training), tuple(broadcast),
                         int(TRAINER_OVERHEAD_GIB * GIB) if on_gpu else 0, tuple(host), ckpt, checkpointed)


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of an engine (host RAM for a CPU engine): with tensor parallelism, each of its GPUs alike."""

    kind: str
    budget: int  # what the engine takes of each of its GPUs
    weights: int  # its shard of the weights
    overhead: int
    kv_bytes_per_token: int  # its KV heads' share of a token
    max_model_len: int
    note: str = ""
    tensor_parallel: int = 1  # GPUs of the engine
    # vLLM stages each weight update whole on every worker, outside its memory budget, on the GPU when the update
    # fits in what the budget leaves; otherwise it streams the update into its weights while generation pauses
    # (`engines/vllm/worker_extension.update_mode`), or, with PIPELINERL_VLLM_STAGING=cpu, stages it in page-locked
    # host memory. 0: the engine receives in place (embedded) or per call (SGLang).
    staging: int = 0
    gpu_bytes: int = 0
    colocated: bool = False  # the trainer takes its share of the same GPU: staged in host memory to be safe
    staging_choice: str = "auto"  # PIPELINERL_VLLM_STAGING

    @property
    def staging_on_gpu(self) -> bool:
        if self.staging_choice in ("cpu", "stream"):
            return False
        return bool(self.staging) and not self.colocated and (
            self.staging_choice == "gpu" or self.budget + self.staging <= self.gpu_bytes)

    @property
    def streamed(self) -> bool:
        """Updates go straight into the weights during a pause: no staging memory anywhere."""
        if not self.staging or self.staging_on_gpu:
            return False
        return self.staging_choice == "stream" or (self.staging_choice == "auto" and not self.colocated)

    @property
    def host_staging(self) -> int:
        """Host memory one worker stages an update in (page-locked): the whole update, or 0."""
        return self.staging if self.staging and not self.staging_on_gpu and not self.streamed else 0

    @property
    def kv_room(self) -> int:
        return self.budget - self.weights - self.overhead

    @property
    def tokens(self) -> int:
        return max(0, self.kv_room) // self.kv_bytes_per_token

    @property
    def sequences(self) -> int:
        return self.tokens // self.max_model_len


def engine_overhead(shape: ModelShape, cfg: RunConfig) -> int:
    wb, tp = DTYPE_BYTES[cfg.model.dtype], cfg.engine.tensor_parallel_size
    chunk = ENGINE_PREFILL_TOKENS * (4 * shape.hidden_size + 3 * shape.intermediate_size // tp) * wb
    sampler = cfg.engine.max_running_seqs * shape.vocab_size * 8
    return int(ENGINE_OVERHEAD_GIB * GIB) + chunk + sampler


def _takes_gpu_share(kind: str) -> bool:
    """The engine holds a share of its GPU (engine.gpu_memory_utilization), not KV for engine.max_batch_tokens."""
    return engine_kind(kind).gpu_memory_flag is not None


def engine_memory(shape: ModelShape, cfg: RunConfig, gpu_bytes: int) -> EngineMemory:
    """One GPU of an engine, of `gpu_bytes` (0: on CPU, where it holds KV for `engine.max_batch_tokens`)."""
    e = cfg.engine
    wb, tp = DTYPE_BYTES[cfg.model.dtype], e.tensor_parallel_size
    weights = math.ceil(shape.num_params * wb / tp)
    kv = 2 * shape.num_layers * math.ceil(shape.num_kv_heads / tp) * shape.head_dim * wb
    kind = engine_kind(e.kind)
    if gpu_bytes == 0 or kind.gpu_memory_flag is None:
        # sized by engine.max_batch_tokens, not by a share of the device
        overhead = engine_overhead(shape, cfg) if gpu_bytes else 0
        return EngineMemory(e.kind, weights + overhead + kv * e.max_batch_tokens, weights, overhead, kv,
                            e.max_model_len, f"KV for engine.max_batch_tokens {e.max_batch_tokens}", tp)
    util = e.gpu_memory_utilization
    staging, choice = kind.staging_bytes(shape, wb) if kind.staging_bytes else (0, "auto")
    return EngineMemory(e.kind, int(util * gpu_bytes), weights, engine_overhead(shape, cfg), kv, e.max_model_len,
                        f"engine.gpu_memory_utilization {util:g} x {_gib(gpu_bytes)} GiB", tp, staging, gpu_bytes,
                        e.colocate_with_trainer, choice)
