"""`pipelinerl plan RECIPE`: where every process of a recipe goes and the memory each GPU will need, worked out
on any machine (no GPU, no download) from the recipe and the model's shape, with a verdict and the changes that
would make a recipe fit.

Placement is `placement.plan_node` for every node of the cluster, so the plan is the launcher's own. Memory is
an estimate from the model's shape; every figure below is in bytes (GiB = 2**30 bytes), N = parameters, T =
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
- Logits: computed `trainer.logprob_chunk_tokens` rows at a time (`rl.packing.ChunkedHeadLogprobs`), never for
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

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.config import ConfigError, RunConfig, load_config, resolve_for_machine
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.placement import NodeEnv, NodePlan, listed_gpus, plan_node

GIB = 2**30
MIB = 2**20
TRAINER_OVERHEAD_GIB = 3.0  # CUDA context (~0.5-1 GiB with NCCL), communicator buffers, allocator fragmentation
ENGINE_OVERHEAD_GIB = 2.0  # CUDA context, CUDA graphs, the weight-update group's NCCL buffers
ENGINE_PREFILL_TOKENS = 8192  # vLLM's and SGLang's default chunked-prefill size on large GPUs
LOGIT_BYTES = 12  # per token per vocabulary entry at the log-softmax backward's peak (see the module docstring)
MIN_SEQUENCES = 8  # fewer full-length sequences in the KV cache than this and an engine crawls
ZERO3_MIN_GATHER = 64 * MIB  # Trainer._zero3_parameters gathers at least this much at a time
PACK_BUFFERS = 2  # weight_sync.PIPELINE_DEPTH: packing buffers of one bucket each on the sending rank
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- model shape ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k and v (not on o)
    source: str = ""  # where the shape came from

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attention + mlp + 2 * h  # two RMSNorm gains

    @property
    def embedding_params(self) -> int:
        """One V x h matrix (the input embedding; the LM head is another unless tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.embedding_params + self.num_layers * self.layer_params + self.hidden_size

    @property
    def largest_tensor(self) -> int:
        return max(self.embedding_params, self.hidden_size * self.intermediate_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                head_dim=hidden // heads, vocab_size=vocab, tie_word_embeddings=tied)


# The published config.json of each Qwen2.5 base model on the Hugging Face hub (the -Instruct models share them).
QWEN25_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen/Qwen2.5-14B": _qwen25(5120, 13824, 48, 40, 8, 152064, False),
    "Qwen/Qwen2.5-32B": _qwen25(5120, 27648, 64, 40, 8, 152064, False),
    "Qwen/Qwen2.5-72B": _qwen25(8192, 29568, 80, 64, 8, 152064, False),
}


def known_shape(name: str) -> ModelShape | None:
    base = name.removesuffix("-Instruct")
    if base not in QWEN25_CONFIGS:
        return None
    return ModelShape(name=name, source="built-in table of published configs", **QWEN25_CONFIGS[base])


def shape_from_hf_config(config: dict[str, Any], name: str, source: str) -> ModelShape:
    """A Hugging Face config.json's shape. Raises ConfigError naming a missing key."""
    def need(key: str) -> int:
        if key not in config:
            raise ConfigError(f"model.path: {source} has no {key!r}; a decoder-only transformer config is needed")
        return int(config[key])

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    model_type = config.get("model_type", "")
    # transformers' PretrainedConfig ties by default; Qwen2Config overrides it to untied
    tied = bool(config.get("tie_word_embeddings", model_type != "qwen2"))
    return ModelShape(name=name, hidden_size=hidden, intermediate_size=need("intermediate_size"),
                      num_layers=need("num_hidden_layers"), num_heads=heads,
                      num_kv_heads=int(config.get("num_key_value_heads") or heads),
                      head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=need("vocab_size"),
                      tie_word_embeddings=tied, qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
                      source=source)


def tiny_shape(cfg: RunConfig) -> ModelShape:
    """The shape `model.init=tiny` will build (pipelinerl.models.tiny) before it exists on disk."""
    import inspect

    from pipelinerl.models import tiny

    m = cfg.model
    defaults = {k: p.default for k, p in inspect.signature(tiny.build_tiny_model).parameters.items()}
    if m.tiny_tokenizer == "bpe":
        vocab = m.tiny_vocab_size
    else:
        vocab = len(tiny.SPECIAL_TOKENS) + len(dict.fromkeys(tiny.CHARACTERS))
    h = m.tiny_hidden_size
    heads = defaults["num_heads"]
    return ModelShape(name=f"tiny ({m.path})", hidden_size=h, intermediate_size=4 * h, num_layers=m.tiny_layers,
                      num_heads=heads, num_kv_heads=defaults["num_kv_heads"], head_dim=h // heads, vocab_size=vocab,
                      tie_word_embeddings=bool(defaults["tie_embeddings"]), source="model.init=tiny")


def model_shape(cfg: RunConfig) -> ModelShape:
    """From `model.path`'s config.json when it is a local directory, the shape `model.init=tiny` will build,
    or the built-in table of published configs by name."""
    path = Path(cfg.model.path)
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: cannot read {config}: {e}") from None
        return shape_from_hf_config(data, str(path), str(config))
    if cfg.model.init == "tiny":
        return tiny_shape(cfg)
    shape = known_shape(cfg.model.path)
    if shape is None:
        where = "is a directory without a config.json" if path.is_dir() else "is not a local directory"
        raise ConfigError(f"model.path: {cfg.model.path!r} {where} and not a model this planner knows "
                          f"({', '.join(QWEN25_CONFIGS)}); pass a local copy of the model (or just its "
                          "config.json in a directory): model.path=/models/NAME")
    return shape


# --- trainer sharding ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    kind: str  # none | ddp | zero0 | zero1 | zero2 | zero3 | fsdp
    ranks: int
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False  # FSDP's own (fsdp_activation_checkpointing)
    source: str = ""

    @property
    def deepspeed(self) -> bool:
        return self.kind.startswith("zero")

    @property
    def divides(self) -> tuple[bool, bool, bool]:
        """Whether (parameters, gradients, optimizer state) are divided among the ranks."""
        stage = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(self.kind, 0)
        return stage >= 3, stage >= 2, stage >= 1

    def describe(self) -> str:
        what = {"none": "one process, no sharding", "ddp": f"DDP, {self.ranks} replicas",
                "fsdp": f"FSDP full shard over {self.ranks} GPUs"}.get(self.kind)
        if what is None:
            what = f"DeepSpeed ZeRO-{self.kind[-1]} over {self.ranks} GPU{'s' if self.ranks > 1 else ''}"
        off = [name for name, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params)) if on]
        if off:
            what += f", {' and '.join(off)} offloaded to CPU"
        return what + (f" ({self.source})" if self.source else "")


def _read_yaml(path: Path, key: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} is not a YAML mapping")
    return data


def _find(name: str, near: Path) -> Path | None:
    """A path named in a config file: relative to the working directory (as the launcher resolves it), or to
    a directory above the file that names it (configs/deepspeed/... from configs/accelerate/...)."""
    for base in (Path.cwd(), *near.resolve().parents):
        if (base / name).is_file():
            return base / name
    return None


def _offloaded(device: Any) -> bool:
    return str(device or "none").lower() in ("cpu", "nvme")


def detect_sharding(cfg: RunConfig) -> Sharding:
    """How the trainer's state is split, from `trainer.accelerate_config` (and the DeepSpeed JSON it names)."""
    t = cfg.trainer
    n = t.num_processes
    plain = Sharding("ddp" if n > 1 else "none", n)
    if not t.accelerate_config:
        return plain
    path = Path(t.accelerate_config)
    y = _read_yaml(path, "trainer.accelerate_config")
    kind = str(y.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        ds = y.get("deepspeed_config") or {}
        stage = ds.get("zero_stage", 0)
        off_opt, off_par = ds.get("offload_optimizer_device"), ds.get("offload_param_device")
        source = str(path)
        if ds.get("deepspeed_config_file"):
            found = _find(str(ds["deepspeed_config_file"]), path)
            if found is None:
                raise ConfigError(f"trainer.accelerate_config: {path} names the DeepSpeed config "
                                  f"{ds['deepspeed_config_file']!r}, which does not exist")
            try:
                zero = json.loads(found.read_text()).get("zero_optimization") or {}
            except (OSError, ValueError) as e:
                raise ConfigError(f"trainer.accelerate_config: cannot read {found}: {e}") from None
            stage = zero.get("stage", 0)
            off_opt = (zero.get("offload_optimizer") or {}).get("device")
            off_par = (zero.get("offload_param") or {}).get("device")
            source = f"{path} -> {ds['deepspeed_config_file']}"
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"trainer.accelerate_config: {source}: ZeRO stage {stage!r} is not 0-3")
        return Sharding(f"zero{stage}", n, _offloaded(off_opt), _offloaded(off_par) and stage == 3, source=source)
    if kind == "FSDP":
        f = y.get("fsdp_config") or {}
        if str(f.get("fsdp_sharding_strategy", "FULL_SHARD")).upper() in ("NO_SHARD", "3"):
            return dataclasses.replace(plain, source=str(path))
        offload = bool(f.get("fsdp_offload_params"))
        return Sharding("fsdp", n, offload, offload, bool(f.get("fsdp_activation_checkpointing")), str(path))
    return dataclasses.replace(plain, source=str(path))


# --- memory --------------------------------------------------------------------------------------------------


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


# --- the plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    host_memory_gib: float = 0.0  # per node; 0: not known (not checked)
    host_memory_guessed: bool = False  # this machine's, which has no GPU: a warning, not a verdict

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    def describe(self) -> str:
        if self.gpus_per_node == 0:
            return f"{self.nodes} node{'s' if self.nodes > 1 else ''}, CPU only"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} "
                f"GPU{'s' if self.gpus_per_node > 1 else ''} of "
                f"{self.gpu_memory_gib:g} GiB")


@dataclass(frozen=True)
class GpuUse:
    node: int
    gpu: int
    roles: tuple[str, ...]  # "trainer rank 0", "engine 3"; empty: idle
    need: int
    capacity: int


@dataclass(frozen=True)
class Suggestion:
    changes: dict[str, Any]  # config key (or flag) -> value
    text: str
    enough: bool  # makes the recipe fit on its own


@dataclass
class Plan:
    cluster: Cluster
    shape: ModelShape
    sharding: Sharding
    nodes: list[NodePlan]
    trainer_main: TrainerMemory
    trainer_other: TrainerMemory | None  # None with one trainer rank
    engine: EngineMemory | None  # None without engines
    gpus: list[GpuUse]
    colocated: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_per_node(self) -> list[int]:
        """Host memory each node needs (`host_memory`)."""
        return [host_memory(self, n) for n in self.nodes]

    @property
    def on_gpu(self) -> bool:
        return self.cluster.gpus_per_node > 0

    @property
    def trainer_fits(self) -> bool:
        return not any(p.startswith("trainer") for p in self.problems)


def place(cfg: RunConfig, cluster: Cluster) -> list[NodePlan]:
    """`plan_node` for every node. Nodes other than 0 reach node 0 at a placeholder non-loopback address, so a
    multi-node recipe whose engines bind a loopback address fails here as it would at launch."""
    master = "node0" if cluster.nodes > 1 else "127.0.0.1"
    return [plan_node(cfg, NodeEnv(cluster.nodes, rank, master), cluster.gpus_per_node)
            for rank in range(cluster.nodes)]


def make_plan(cfg: RunConfig, cluster: Cluster) -> Plan:
    """The whole plan: placement, memory per GPU, problems, warnings and (when it does not fit) suggestions.
    Raises ConfigError for a recipe that cannot be placed at all."""
    cfg, _ = resolve_for_machine(cfg, cluster.gpus_per_node)  # "auto" dtype and backend, as the launcher would
    plan = _plan(cfg, cluster, model_shape(cfg), detect_sharding(cfg))
    if plan.on_gpu and not plan.fits:
        plan.suggestions = suggestions(cfg, plan)
    return plan


def _plan(cfg: RunConfig, cluster: Cluster, shape: ModelShape, sharding: Sharding) -> Plan:
    """The plan without suggestions, for a shape and sharding worked out once (the suggestions try shardings
    whose configs do not exist as files)."""
    nodes = place(cfg, cluster)
    on_gpu = cluster.gpus_per_node > 0
    colocated = on_gpu and cfg.engine.colocate_with_trainer
    main = trainer_memory(shape, cfg, sharding, main=True, on_gpu=on_gpu)
    other = trainer_memory(shape, cfg, sharding, main=False, on_gpu=on_gpu) if sharding.ranks > 1 else None
    has_engines = any(n.engines for n in nodes)
    engine = engine_memory(shape, cfg, cluster.gpu_bytes if on_gpu else 0) if has_engines else None
    gpus = _gpu_uses(nodes, cluster, main, other, engine)
    plan = Plan(cluster, shape, sharding, nodes, main, other, engine, gpus, colocated)
    if on_gpu:
        _check(plan)
    return plan


def _gpu_uses(nodes: list[NodePlan], cluster: Cluster, main: TrainerMemory, other: TrainerMemory | None,
              engine: EngineMemory | None) -> list[GpuUse]:
    uses = []
    for node_plan in nodes:
        rank = node_plan.node.rank
        for gpu in range(cluster.gpus_per_node):
            roles, need = [], 0
            if gpu in node_plan.trainer_gpus:
                r = node_plan.first_trainer_rank + node_plan.trainer_gpus.index(gpu)
                roles.append(f"trainer rank {r}")
                need += (main if r == 0 else other or main).total
            for slot in node_plan.engines:
                if gpu in slot.gpus and engine is not None:
                    roles.append(f"engine {slot.index}")
                    need += engine.budget
            uses.append(GpuUse(rank, gpu, tuple(roles), need, cluster.gpu_bytes))
    return uses


# Host memory of each process beside what the plan counts (Python, torch and CUDA's host side, vLLM's scheduler,
# DeepSpeed's buffers): a round figure, so that a node whose host memory is nearly full is still caught.
HOST_PROCESS_GIB = 6.0


def host_memory(plan: Plan, node: NodePlan) -> int:
    """Host memory node `node` needs: per trainer process its offloaded state and HOST_PROCESS_GIB, per engine
    worker HOST_PROCESS_GIB and, where updates are staged in host memory, the whole update."""
    per_process = int(HOST_PROCESS_GIB * GIB)
    need = 0
    for k in range(node.trainer_processes if node.runs_trainer else 0):
        rank = node.first_trainer_rank + k
        need += (plan.trainer_main if rank == 0 else plan.trainer_other or plan.trainer_main).host_bytes + per_process
    workers = sum(len(s.gpus) or 1 for s in node.engines)
    staging = plan.engine.host_staging if plan.engine is not None else 0
    return need + workers * (per_process + staging)


def _check(plan: Plan) -> None:
    """Problems (the recipe does not fit) and warnings, one per kind of GPU rather than one per GPU."""
    seen: set[tuple[tuple[str, ...], int]] = set()
    for use in plan.gpus:
        key = (_role_kind(use.roles), use.need)
        if use.need <= use.capacity or key in seen:
            continue
        seen.add(key)
        alike = [u for u in plan.gpus if (_role_kind(u.roles), u.need) == key]
        what = "trainer" if any(r.startswith("trainer") for r in use.roles) else "engine"
        nodes = sorted({u.node for u in alike})
        where = "; ".join(f"node {n} GPU{'s' if sum(u.node == n for u in alike) > 1 else ''} "
                          f"{_range([u.gpu for u in alike if u.node == n])}" for n in nodes)
        roles = _describe_roles(alike).removesuffix(" (main process: broadcasts weights)")
        text = (f"{what}: {where} ({roles}) need{'s' if len(alike) == 1 else ''} "
                f"{_gib(use.need)} GiB{' each' if len(alike) > 1 else ''}; a GPU has {_gib(use.capacity)} GiB")
        if plan.colocated and what == "trainer" and plan.engine is not None:
            text += f" (the engine's share, {_gib(plan.engine.budget)} GiB, included)"
        plan.problems.append(text)
    host = plan.cluster.host_memory_gib * GIB
    if host:
        short = [(n.node.rank, need) for n, need in zip(plan.nodes, plan.host_per_node) if need > host]
        if short:
            rank, need = max(short, key=lambda x: x[1])
            staged = plan.engine is not None and plan.engine.host_staging
            why = (f" ({_gib(plan.engine.host_staging)} GiB of it per engine worker: weight updates staged in host "
                   "memory by PIPELINERL_VLLM_STAGING=cpu; leave it unset to stream them instead)" if staged else "")
            text = (f"host: node{'s' if len(short) > 1 else ''} {_range([r for r, _ in short])} "
                    f"need{'s' if len(short) == 1 else ''} up to {_gib(need)} GiB of host memory, and a node has "
                    f"{_gib(host)} GiB{why}")
            if plan.cluster.host_memory_guessed:
                plan.warnings.append(f"{text}: this machine's memory, and it has no GPU, so it is probably not a node "
                                     "of this cluster; pass --host-memory with the nodes' memory to check")
            else:
                plan.problems.append(f"{text} (--host-memory)")
    e = plan.engine
    if e is None:
        return
    if e.sequences < 1:
        plan.problems.append(
            f"engine: the weights ({_gib(e.weights)} GiB) and overhead ({_gib(e.overhead)} GiB) leave "
            f"{_gib(max(0, e.kv_room))} GiB of the engine's {_gib(e.budget)} GiB ({e.note}) for KV cache: not one "
            f"sequence of engine.max_model_len {e.max_model_len} tokens "
            f"({_gib(e.kv_bytes_per_token * e.max_model_len)} GiB)")
    elif e.sequences < MIN_SEQUENCES:
        # fewer than max_running_seqs is normal with a long max_model_len (vLLM/SGLang queue the rest); this few
        # leaves the GPU idle between few decode steps
        plan.warnings.append(
            f"engine: KV cache for only {e.sequences} sequences of engine.max_model_len {e.max_model_len} tokens "
            f"({e.tokens:,} tokens); under {MIN_SEQUENCES} the engine decodes few sequences at a time and crawls")


# --- suggestions ---------------------------------------------------------------------------------------------


def _variant(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """`cfg` with some keys changed, validated like a loaded config (raises ConfigError)."""
    changed = {name: dataclasses.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    return dataclasses.replace(cfg, **changed)


def _try(base: Plan, cfg: RunConfig, sharding: Sharding, **sections: dict[str, Any]) -> Plan | None:
    """`base`'s recipe with some keys changed (see _variant) and `sharding`, planned on the same cluster and model;
    None if the change is not a valid config or cannot be placed."""
    try:
        return _plan(_variant(cfg, **sections), base.cluster, base.shape, sharding)
    except ConfigError:
        return None


@dataclass(frozen=True)
class _Option:
    """One change to the trainer: config sections to replace and the sharding it implies."""

    tag: str  # checkpointing | micro_batch | ranks | offload_optimizer | offload_params
    changes: dict[str, Any]
    text: str
    sections: dict[str, dict[str, Any]]
    sharding: Sharding


OFFLOAD_TEXT = ("DeepSpeed ZeRO-3 with {what} offloaded to CPU (trainer.accelerate_config: an accelerate YAML "
                "naming a copy of configs/deepspeed/zero3.json with {keys} and zero_force_ds_cpu_optimizer=false, as "
                "the trainer builds torch AdamW)")


def suggestions(cfg: RunConfig, plan: Plan) -> list[Suggestion]:
    """Changes that make the recipe fit, each tried by planning again: single trainer changes (with what each
    saves), all of them together in order when none is enough alone, the engine's share when engines share the
    trainer's GPUs, engine changes when an engine has no KV room, and the GPU memory that fits it as it is."""
    out: list[Suggestion] = []
    cluster, e = plan.cluster, cfg.engine
    util = e.gpu_memory_utilization
    if not plan.trainer_fits:
        options = _trainer_options(cfg, plan)
        for option in options:
            tried = _try(plan, cfg, option.sharding, **option.sections)
            if tried is None or tried.trainer_main.total >= plan.trainer_main.total:
                continue
            saved = plan.trainer_main.total - tried.trainer_main.total
            out.append(Suggestion(option.changes, f"{option.text}: {_gib(tried.trainer_main.total)} GiB on trainer "
                                                  f"rank 0 (saves {_gib(saved)} GiB)"
                                                  + ("" if tried.trainer_fits else ", not enough alone"),
                                  tried.fits))
        if options and not any(s.enough for s in out):
            combined = _combined(cfg, plan, options)
            if combined is not None:
                out.append(combined)
        if plan.colocated and plan.engine is not None:
            lower = math.floor((cluster.gpu_bytes - plan.trainer_main.total) / cluster.gpu_bytes * 100) / 100
            if 0 < lower < util:
                tried = _try(plan, cfg, plan.sharding, engine={"gpu_memory_utilization": lower})
                if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                    out.append(Suggestion({"engine.gpu_memory_utilization": lower},
                                          f"engine.gpu_memory_utilization={lower:g}: the engine leaves the trainer "
                                          f"{_gib(cluster.gpu_bytes - tried.engine.budget)} GiB and holds "
                                          f"{tried.engine.sequences} sequences", tried.fits))
    eng = plan.engine
    if eng is not None and eng.sequences < 1 and _takes_gpu_share(e.kind):
        if util < 0.95 and not plan.colocated:
            tried = _try(plan, cfg, plan.sharding, engine={"gpu_memory_utilization": 0.95})
            if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                out.append(Suggestion({"engine.gpu_memory_utilization": 0.95},
                                      f"engine.gpu_memory_utilization=0.95: KV room for {tried.engine.sequences} "
                                      "sequences", tried.fits))
        tp = e.tensor_parallel_size * 2
        while not plan.colocated and tp <= cluster.gpus_per_node:  # split each engine over more GPUs
            tried = _try(plan, cfg, plan.sharding, engine={"tensor_parallel_size": tp})
            if tried is not None and tried.engine is not None and tried.engine.sequences >= 1:
                engines = sum(len(n.engines) for n in tried.nodes)
                out.append(Suggestion({"engine.tensor_parallel_size": tp},
                                      f"engine.tensor_parallel_size={tp}: {engines} engines of {tp} GPUs, each with "
                                      f"KV room for {tried.engine.sequences} sequences", tried.fits))
                break
            tp *= 2
        if eng.tokens > cfg.sampling.max_new_tokens + 1:
            out.append(Suggestion({"engine.max_model_len": eng.tokens},
                                  f"engine.max_model_len={eng.tokens} (and sampling.max_new_tokens below it): the "
                                  "KV room holds one sequence that long, no more", False))
    need_gib = minimum_gpu_memory(cfg, plan)
    if need_gib is not None and need_gib > cluster.gpu_memory_gib:
        out.append(Suggestion({"resources.gpu_memory_gib": need_gib},
                              f"GPUs of at least {need_gib} GiB (--gpu-memory {need_gib}, "
                              f"resources.gpu_memory_gib={need_gib})", True))
    return out


def _trainer_options(cfg: RunConfig, plan: Plan) -> list[_Option]:
    """Single changes that shrink a trainer GPU's memory, in the order they are combined: the cheapest first."""
    t, e = cfg.trainer, cfg.engine
    cluster, sharding = plan.cluster, plan.sharding
    options: list[_Option] = []

    def add(option: _Option) -> None:
        try:
            _variant(cfg, **option.sections)
        except ConfigError:
            return
        options.append(option)

    if not plan.trainer_main.checkpointing:
        add(_Option("checkpointing", {"trainer.gradient_checkpointing": True}, "trainer.gradient_checkpointing=true",
                    {"trainer": {"gradient_checkpointing": True}}, sharding))
    # the largest smaller micro-batch that fits, but at least engine.max_model_len (one whole sample)
    sizes = _micro_batch_sizes(t.micro_batch_tokens, e.max_model_len)
    for size in sizes:
        tried = _try(plan, cfg, sharding, trainer={"micro_batch_tokens": size})
        if tried is not None and tried.trainer_fits:
            break
    if sizes:
        add(_Option("micro_batch", {"trainer.micro_batch_tokens": size}, f"trainer.micro_batch_tokens={size}",
                    {"trainer": {"micro_batch_tokens": size}}, sharding))
    # more trainer GPUs, sharded: the fewest that fit (or all the trainer nodes can give), the same on each
    most = cluster.gpus_per_node * t.num_nodes - (0 if cluster.nodes > t.num_nodes or plan.colocated else 1)
    zero3 = "configs/accelerate/deepspeed_zero3.yaml"
    for ranks in range(t.num_processes + 1, most + 1):
        if ranks % t.num_nodes:
            continue
        trainer: dict[str, Any] = {"num_processes": ranks}
        new_sharding = dataclasses.replace(sharding, ranks=ranks)
        if not sharding.divides[0] and Path(zero3).is_file():  # replicated parameters: shard them
            trainer["accelerate_config"] = zero3
            new_sharding = Sharding("zero3", ranks, sharding.offload_optimizer, sharding.offload_params, source=zero3)
        sections: dict[str, dict[str, Any]] = {"trainer": trainer}
        left = (cluster.gpus_per_node - ranks // t.num_nodes) // e.tensor_parallel_size
        if e.num_engines and cluster.nodes == 1 and not plan.colocated and e.num_engines > left:
            sections["engine"] = {"num_engines": left}
        tried = _try(plan, cfg, new_sharding, **sections)
        if tried is not None and (tried.trainer_fits or ranks == most):
            changes = {f"{name}.{k}": v for name, keys in sections.items() for k, v in keys.items()}
            text = ", ".join(f"{k}={v}" for k, v in changes.items())
            add(_Option("ranks", changes, f"{text} (fewer GPUs left for engines)", sections, new_sharding))
            break
    if not sharding.offload_optimizer:
        add(_Option("offload_optimizer", {"trainer.accelerate_config": "ZeRO-3 + offload_optimizer"},
                    OFFLOAD_TEXT.format(what="the optimizer",
                                        keys="zero_optimization.offload_optimizer.device=cpu"), {},
                    Sharding("zero3", t.num_processes, True, False, source="offload")))
    if not sharding.offload_params:
        add(_Option("offload_params", {"trainer.accelerate_config": "ZeRO-3 + offload_optimizer + offload_param"},
                    OFFLOAD_TEXT.format(what="optimizer and parameters",
                                        keys="offload_optimizer.device=cpu and offload_param.device=cpu"), {},
                    Sharding("zero3", t.num_processes, True, True, source="offload")))
    return options


def _micro_batch_sizes(current: int, floor: int) -> list[int]:
    """Smaller micro-batch sizes to try, largest first: halvings of the current one, then `floor`."""
    sizes, size = [], current
    while size // 2 >= floor:
        size //= 2
        sizes.append(size)
    if floor < current and floor not in sizes:
        sizes.append(floor)
    return sizes


def _combined(cfg: RunConfig, plan: Plan, options: list[_Option]) -> Suggestion | None:
    """The trainer changes applied one after another until the trainer fits; None if even all do not."""
    changes: dict[str, Any] = {}
    texts: dict[str, str] = {}
    sections: dict[str, dict[str, Any]] = {}
    sharding = plan.sharding
    tried: Plan | None = None
    for option in options:
        for name, keys in option.sections.items():
            sections.setdefault(name, {}).update(keys)
        if option.tag == "ranks":
            sharding = dataclasses.replace(option.sharding, offload_optimizer=sharding.offload_optimizer,
                                           offload_params=sharding.offload_params)
        elif option.tag.startswith("offload"):
            sharding = Sharding("zero3", sharding.ranks, True, option.sharding.offload_params, source="offload")
            texts.pop("offload_optimizer", None)  # the parameters' offload includes the optimizer's
        changes.update(option.changes)
        texts[option.tag] = option.text.split(" (fewer")[0]
        tried = _try(plan, cfg, sharding, **sections)
        if tried is not None and tried.trainer_fits:
            return Suggestion(dict(changes), "all together: " + "; ".join(texts.values())
                              + f": {_gib(tried.trainer_main.total)} GiB on trainer rank 0", tried.fits)
    if tried is None:
        return None
    return Suggestion(dict(changes), f"even all of the above together: {_gib(tried.trainer_main.total)} GiB on "
                                     "trainer rank 0, not enough", False)


def minimum_gpu_memory(cfg: RunConfig, plan: Plan) -> int | None:
    """Whole GiB per GPU that fits the recipe as it is, with room for MIN_SEQUENCES sequences per engine."""
    if not plan.on_gpu:
        return None
    trainer = max(plan.trainer_main.total, plan.trainer_other.total if plan.trainer_other else 0)
    need = float(trainer)
    e = plan.engine
    if e is not None and _takes_gpu_share(e.kind):
        util = cfg.engine.gpu_memory_utilization
        engine_need = (e.weights + e.overhead + MIN_SEQUENCES * e.max_model_len * e.kv_bytes_per_token) / util
        if plan.colocated:
            need = max(trainer / (1 - util) if util < 1 else math.inf, engine_need)
        else:
            need = max(need, engine_need)
    elif e is not None:
        need = max(need, float(e.budget + (trainer if plan.colocated else 0)))
    return math.ceil(need / GIB) if math.isfinite(need) else None


# --- output --------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _range(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _placement_rows(plan: Plan, cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """(nodes, GPUs, what runs there, need) rows, consecutive alike GPUs and then alike nodes merged."""
    per_node: list[list[tuple[str, str, str]]] = []
    for node_plan in plan.nodes:
        rank = node_plan.node.rank
        rows: list[tuple[str, str, str]] = []
        uses = [u for u in plan.gpus if u.node == rank]
        groups: list[list[GpuUse]] = []
        for use in uses:
            last = groups[-1][-1] if groups else None
            if (last is not None and last.need == use.need and _role_kind(last.roles) == _role_kind(use.roles)
                    and "trainer rank 0" not in last.roles and "trainer rank 0" not in use.roles):
                groups[-1].append(use)
            else:
                groups.append([use])
        for group in groups:
            gpus = _range([u.gpu for u in group])
            rows.append((gpus, _describe_roles(group), _gib(group[0].need) if group[0].roles else "-"))
        if not plan.on_gpu:
            if node_plan.runs_trainer:
                ranks = node_plan.trainer_processes
                rows.append(("CPU", "trainer" + (f" ({ranks} processes)" if ranks > 1 else ""), ""))
            if node_plan.engines:
                rows.append(("CPU", _describe_roles([GpuUse(rank, 0, (f"engine {s.index}",), 0, 0)
                                                     for s in node_plan.engines]), ""))
        if node_plan.main:
            rows.append(("CPU", f"actor, reward pool ({cfg.reward.workers} worker"
                                f"{'s' if cfg.reward.workers > 1 else ''})", "-" if plan.on_gpu else ""))
        per_node.append(rows)
    merged: list[tuple[str, str, str, str]] = []
    i = 0
    while i < len(per_node):
        j = i
        while j + 1 < len(per_node) and per_node[j + 1] == per_node[i]:
            j += 1
        label = _range([plan.nodes[k].node.rank for k in range(i, j + 1)])
        for gpus, what, need in per_node[i]:
            merged.append((label, gpus, what + (" (each node)" if j > i else ""), need))
        i = j + 1
    return merged


def _role_kind(roles: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(r.rsplit(" ", 1)[0] for r in roles)


def _describe_roles(group: list[GpuUse]) -> str:
    if not group[0].roles:
        return "idle"
    parts = []
    for k in range(len(group[0].roles)):
        kind = group[0].roles[k].rsplit(" ", 1)[0]
        numbers = [int(u.roles[k].rsplit(" ", 1)[1]) for u in group]
        parts.append(f"{kind}{'s' if len(numbers) > 1 else ''} {_range(numbers)}")  # engines, trainer ranks
    text = " + ".join(parts)
    return text + (" (main process: broadcasts weights)" if "trainer rank 0" in group[0].roles else "")


def format_plan(plan: Plan, cfg: RunConfig, recipe: str = "") -> str:
    s, t, e = plan.shape, cfg.trainer, cfg.engine
    out: list[str] = []
    out.append(f"pipelinerl plan {recipe}: {plan.cluster.describe()}".replace("plan :", "plan:"))
    out.append(f"model    {s.name} ({s.source}): {_count(s.num_params)} parameters; hidden {s.hidden_size}, "
               f"{s.num_layers} layers, {s.num_heads} heads ({s.num_kv_heads} KV, head_dim {s.head_dim}), "
               f"intermediate {s.intermediate_size}, vocab {s.vocab_size}, "
               f"{'tied' if s.tie_word_embeddings else 'untied'} embeddings")
    precision = _precision(cfg, plan.on_gpu)
    over = f" over {t.num_nodes} nodes ({t.num_processes // t.num_nodes} each)" if t.num_nodes > 1 else ""
    out.append(f"trainer  {t.num_processes} process{'es' if t.num_processes > 1 else ''}{over}, "
               f"{plan.sharding.describe()}; "
               f"mixed precision {precision}, gradient checkpointing "
               f"{'on' if plan.trainer_main.checkpointing else 'off'}, micro-batch {t.micro_batch_tokens} tokens, "
               f"{t.attn_implementation} attention")
    engines = sum(len(n.engines) for n in plan.nodes)
    tp = f", tensor parallel {e.tensor_parallel_size} ({e.tensor_parallel_size} GPUs each)" \
        if e.tensor_parallel_size > 1 else ""
    out.append(f"engines  {engines} x {e.kind}{tp}, {cfg.model.dtype} weights, max_model_len {e.max_model_len}, "
               f"max_running_seqs {e.max_running_seqs}"
               + (f", gpu_memory_utilization {e.gpu_memory_utilization:g}" if plan.on_gpu else "")
               + (", sharing the trainer's GPUs" if plan.colocated else ""))
    out.append("")
    rows = _placement_rows(plan, cfg)
    head = ("node", "GPU" if plan.on_gpu else "on", "runs", "GiB needed" if plan.on_gpu else "")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(4)]
    out.append("placement")
    for r in [head, *rows]:
        out.append(("  " + "  ".join(r[k].ljust(widths[k]) if k < 3 else r[k].rjust(widths[k])
                                     for k in range(4))).rstrip())
    out.append("")
    where = "" if plan.on_gpu else " (host RAM: a CPU recipe)"
    out.extend(_trainer_table(plan, where))
    if plan.engine is not None:
        out.append("")
        out.extend(_engine_table(plan, where))
    out.append("")
    out.extend(_run_lines(plan, cfg))
    out.append("")
    if not plan.on_gpu:
        out.append("verdict: a CPU recipe: nothing to place on GPUs; the figures above are host RAM estimates")
        return "\n".join(out)
    for w in plan.warnings:
        out.append(f"warning: {w}")
    if plan.fits:
        trainer = max(u.need for u in plan.gpus if any(r.startswith("trainer") for r in u.roles))
        text = f"verdict: fits: a trainer GPU needs {_gib(trainer)} of {_gib(plan.cluster.gpu_bytes)} GiB"
        if plan.colocated:
            text += " (with the engine's share)"
        if plan.engine is not None and _takes_gpu_share(plan.engine.kind):
            text += (f"; each engine has KV room for {plan.engine.sequences} sequences of "
                     f"{plan.engine.max_model_len} tokens")
        out.append(text)
    else:
        out.append("verdict: does NOT fit")
        for p in plan.problems:
            out.append(f"  - {p}")
        if plan.suggestions:
            out.append("to make it fit:")
            for sug in plan.suggestions:
                out.append(f"  - {sug.text}")
    return "\n".join(out)


def _checkpoint(plan: Plan, cfg: RunConfig):
    from pipelinerl.sizing import checkpoint_size

    return checkpoint_size(cfg, plan.shape.num_params, plan.sharding.deepspeed, _precision(cfg, plan.on_gpu) == "bf16")


def _start_timeout(plan: Plan, cfg: RunConfig) -> float:
    from pipelinerl.sizing import engine_start_timeout_s

    return engine_start_timeout_s(cfg, plan.shape.num_params)


def _run_lines(plan: Plan, cfg: RunConfig) -> list[str]:
    """Host memory per node, the checkpoints and the disk they take, the engines' start deadline."""
    from pipelinerl.sizing import checkpoints_on_disk, disk_size

    out = ["run"]
    if plan.on_gpu:
        host = plan.cluster.host_memory_gib
        needs = plan.host_per_node
        of = f" of {_gib(host * GIB)} GiB (--host-memory)" if host else ""
        per_node = ", ".join(f"node {n.node.rank} {_gib(x)} GiB" for n, x in zip(plan.nodes, needs))
        out.append(f"  host memory per node: {per_node}{of}")
    size = _checkpoint(plan, cfg)
    held = checkpoints_on_disk(cfg)
    out.append(f"  checkpoint: {size.describe()}; up to {held} at once in run_dir (trainer.keep_checkpoints "
               f"{cfg.trainer.keep_checkpoints} and the one being written): {disk_size(held * size.total)}; the "
               "launcher refuses a run_dir whose filesystem cannot hold two")
    timeout = _start_timeout(plan, cfg)
    how = "engine.start_timeout_s" if cfg.engine.start_timeout_s is not None else \
        "sized from the weights: engine.start_timeout_s to change it"
    out.append(f"  engines must answer within {timeout:g} s of their start ({how})")
    return out


def _trainer_table(plan: Plan, where: str) -> list[str]:
    main, other = plan.trainer_main, plan.trainer_other
    ranks = plan.sharding.ranks
    cols = ["rank 0"] + ([f"ranks 1-{ranks - 1}" if ranks > 2 else "rank 1"] if other else [])
    whole = [main, other] if other else [main]
    rows: list[tuple[str, str, list[str]]] = []

    def lines_of(kind: str, indent: str) -> None:
        """A row per line of `kind` in any column ("-" where a rank has none; rank 0's note)."""
        for name in dict.fromkeys(x.what for m in whole for x in getattr(m, kind)):
            lines = [next((x for x in getattr(m, kind) if x.what == name), None) for m in whole]
            note = next(x.note for x in lines if x is not None)
            rows.append((indent + name, note, [_gib(x.bytes) if x else "-" for x in lines]))

    lines_of("state", "")
    rows.append(("working set", "the larger of training and broadcast",
                 [_gib(max(m.training_bytes, m.broadcast_bytes)) for m in whole]))
    rows.append(("  training", "one micro-batch, forward and backward", [_gib(m.training_bytes) for m in whole]))
    lines_of("training", "    ")
    rows.append(("  broadcast", "weights to the engines, after the step", [_gib(m.broadcast_bytes) for m in whole]))
    lines_of("broadcast", "    ")
    if main.overhead:
        rows.append(("allowance", f"CUDA context, NCCL, fragmentation ({TRAINER_OVERHEAD_GIB:g} GiB)",
                     [_gib(m.overhead) for m in whole]))
    rows.append(("total", "", [_gib(m.total) for m in whole]))
    title = f"trainer memory{where}, GiB per {'GPU' if plan.on_gpu else 'process'}"
    lines = _table(title, cols, rows)
    if main.host_bytes:
        lines.append(f"  host RAM for offloaded state: {_gib(main.host_bytes)} GiB per rank, "
                     f"{_gib(main.host_bytes * plan.nodes[0].trainer_processes)} GiB on each trainer node ("
                     + ", ".join(f"{x.what} {_gib(x.bytes)}" for x in main.host) + " per rank)")
    return lines


def _engine_table(plan: Plan, where: str) -> list[str]:
    e = plan.engine
    assert e is not None
    tp = e.tensor_parallel
    wb = round(e.weights * tp / plan.shape.num_params)
    whole = "the whole model on each engine" if tp == 1 else f"/ {tp}: this GPU's shard of its engine's model"
    rows = [("budget", e.note, [_gib(e.budget)]), ("weights", f"{wb} B/param, {whole}", [_gib(e.weights)])]
    if e.overhead:
        rows.append(("overhead", f"{ENGINE_OVERHEAD_GIB:g} GiB context/graphs + {ENGINE_PREFILL_TOKENS}-token prefill "
                                 "+ sampler logits", [_gib(e.overhead)]))
    rows.append(("KV cache", f"{e.kv_bytes_per_token:,} B/token: {e.tokens:,} tokens = {e.sequences} sequences of "
                             f"{e.max_model_len}", [_gib(max(0, e.kv_room))]))
    per = "engine" if tp == 1 else f"engine GPU ({tp} per engine)"
    lines = _table(f"engine memory{where}, GiB per {per}", [""], rows)
    if e.staging:
        fits = max(0.0, 1 - e.staging / e.gpu_bytes) if e.gpu_bytes else 0.0
        if e.staging_on_gpu:
            lines.append(f"  weight updates staged on each engine GPU: {_gib(e.staging)} GiB beside the budget")
        elif e.streamed:
            lines.append(f"  weight updates streamed into the weights while generation pauses (staging one takes "
                         f"{_gib(e.staging)} GiB beside the budget, which a GPU does not have): no staging memory; "
                         f"engine.gpu_memory_utilization <= {fits:.2f} would stage them on the GPU and pause only "
                         "for the switch")
        elif e.colocated:
            lines.append(f"  weight updates staged in host memory unless the trainer leaves {_gib(e.staging)} GiB "
                         "free on the shared GPU (checked at each update)")
        else:
            lines.append(f"  weight updates staged in page-locked host memory (PIPELINERL_VLLM_STAGING="
                         f"{e.staging_choice}): {_gib(e.staging)} GiB per engine GPU (the whole update on every "
                         "worker)")
    return lines


def _table(title: str, cols: list[str], rows: list[tuple[str, str, list[str]]]) -> list[str]:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    wc = [max(len(c), *(len(r[2][k]) for r in rows if k < len(r[2]))) for k, c in enumerate(cols)]
    lines = [title]
    if any(cols):
        lines.append("  " + " " * (w0 + w1 + 2) + "  " + "  ".join(c.rjust(wc[k]) for k, c in enumerate(cols)))
    for label, note, values in rows:
        lines.append("  " + label.ljust(w0) + "  " + note.ljust(w1) + "  "
                     + "  ".join(v.rjust(wc[k]) for k, v in enumerate(values)))
    return lines


def plan_to_json(plan: Plan, cfg: RunConfig) -> dict[str, Any]:
    def memory(m: TrainerMemory | None) -> dict[str, Any] | None:
        if m is None:
            return None
        return {**{kind: [dataclasses.asdict(x) for x in getattr(m, kind)]
                   for kind in ("state", "training", "broadcast", "host")},
                "overhead": m.overhead, "checkpointing": m.checkpointing, "training_bytes": m.training_bytes,
                "broadcast_bytes": m.broadcast_bytes, "total_bytes": m.total, "host_bytes": m.host_bytes}

    def cpu(n: NodePlan) -> list[str]:
        """What runs on a node's CPUs: node 0's actor and reward pool, and on a CPU recipe everything."""
        roles = ["actor", f"reward pool ({cfg.reward.workers})"] if n.main else []
        if not plan.on_gpu:
            roles += (["trainer"] if n.runs_trainer else []) + [f"engine {s.index}" for s in n.engines]
        return roles

    e = plan.engine
    return {
        "fits": plan.fits,
        "cluster": dataclasses.asdict(plan.cluster),
        "model": {**dataclasses.asdict(plan.shape), "num_params": plan.shape.num_params},
        "sharding": {**dataclasses.asdict(plan.sharding), "description": plan.sharding.describe()},
        "placement": [{"node": n.node.rank, "trainer_gpus": list(n.trainer_gpus),
                       "trainer_first_rank": n.first_trainer_rank if n.runs_trainer else None,
                       "engines": [{"index": s.index, "gpus": list(s.gpus)} for s in n.engines],
                       "cpu": cpu(n)} for n in plan.nodes],
        "gpus": [{"node": u.node, "gpu": u.gpu, "roles": list(u.roles), "need_bytes": u.need,
                  "capacity_bytes": u.capacity} for u in plan.gpus],
        "trainer": {"rank0": memory(plan.trainer_main), "other_ranks": memory(plan.trainer_other)},
        "engine": None if e is None else {
            "kind": e.kind, "tensor_parallel_size": e.tensor_parallel, "budget_bytes": e.budget,
            "weights_bytes": e.weights, "overhead_bytes": e.overhead,
            "kv_room_bytes": e.kv_room, "kv_bytes_per_token": e.kv_bytes_per_token, "tokens": e.tokens,
            "sequences": e.sequences, "max_model_len": e.max_model_len, "update_staging_bytes": e.staging,
            "update_staging_on_gpu": e.staging_on_gpu, "updates_streamed": e.streamed,
            "update_host_staging_bytes": e.host_staging},
        "host_bytes_per_node": plan.host_per_node,
        "host_memory_bytes": int(plan.cluster.host_memory_gib * GIB),
        "checkpoint_bytes": _checkpoint(plan, cfg).total,
        "engine_start_timeout_s": _start_timeout(plan, cfg),
        "problems": plan.problems,
        "warnings": plan.warnings,
        "suggestions": [dataclasses.asdict(x) for x in plan.suggestions],
    }


# --- command line --------------------------------------------------------------------------------------------


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's resources.nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: resources.gpus_per_node; 0 plans a CPU run)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory per GPU in GiB (default: resources.gpu_memory_gib)")
    parser.add_argument("--host-memory", type=float, default=None, metavar="GIB",
                        help="host memory per node in GiB (default: this machine's; 0: not checked)")
    parser.add_argument("--json", action="store_true", default=None, help="print the plan as JSON")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/orz_7b.yaml")
    # the rest, flags included: argparse alone rejects overrides that follow a flag (`RECIPE --nodes 2 a=b`)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. trainer.lr=1e-6")
    _add_flags(parser)


def _flags_among_overrides(args: argparse.Namespace) -> None:
    """Move flags that came after the recipe out of `args.overrides` into `args`."""
    parser = argparse.ArgumentParser(prog="pipelinerl plan", add_help=False, allow_abbrev=False)
    _add_flags(parser)
    flags, rest = parser.parse_known_args(args.overrides)
    for name, value in vars(flags).items():
        if value is not None:
            setattr(args, name, value)
    unknown = [x for x in rest if x.startswith("-")]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown option (the options are --nodes, --gpus-per-node, --gpu-memory, "
                          "--host-memory, --json)")
    args.overrides = rest


def check_flags(nodes: int | None, gpus: int | None, memory: float | None) -> None:
    """Raises ConfigError naming the flag."""
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes: must be at least 1, got {nodes}")
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--gpus-per-node: must be >= 0 (0: a CPU run), got {gpus}")
    if memory is not None and not memory > 0:
        raise ConfigError(f"--gpu-memory: must be > 0 GiB, got {memory:g}")


def machine_host_memory_gib() -> float:
    """This machine's memory in GiB (/proc/meminfo's MemTotal; 0 where that cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def cluster_of(cfg: RunConfig) -> Cluster:
    """The cluster a recipe is planned for: its `resources` (which the flags override)."""
    r = cfg.resources
    if r.gpus_per_node and r.gpu_memory_gib <= 0:
        raise ConfigError("resources.gpu_memory_gib: the recipe does not state its GPUs' memory; pass --gpu-memory")
    return Cluster(r.nodes, r.gpus_per_node, r.gpu_memory_gib)


def main(args: argparse.Namespace) -> int:
    """0: the recipe fits; 1: it does not; 2: a configuration error."""
    try:
        _flags_among_overrides(args)
        check_flags(args.nodes, args.gpus_per_node, args.gpu_memory)
        # the flags go in as overrides of `resources`, so the config's own checks see the cluster planned for
        flags = {"resources.nodes": args.nodes, "resources.gpus_per_node": args.gpus_per_node,
                 "resources.gpu_memory_gib": args.gpu_memory}
        overrides = list(args.overrides) + [f"{k}={v}" for k, v in flags.items() if v is not None]
        cfg = load_config(args.recipe, overrides)
        if args.host_memory is not None and args.host_memory < 0:
            raise ConfigError(f"--host-memory: must be >= 0 GiB (0: not checked), got {args.host_memory:g}")
        host = machine_host_memory_gib() if args.host_memory is None else args.host_memory
        guessed = args.host_memory is None and cfg.resources.gpus_per_node > 0 and listed_gpus() == 0
        cluster = dataclasses.replace(cluster_of(cfg), host_memory_gib=host, host_memory_guessed=guessed)
        cfg, _ = resolve_for_machine(cfg, cluster.gpus_per_node)  # the report names the dtype it planned
        plan = make_plan(cfg, cluster)
    except ConfigError as e:
        print(f"pipelinerl plan: config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_json(plan, cfg), indent=2))
    else:
        print(format_plan(plan, cfg, args.recipe))
    return 0 if plan.fits else 1
