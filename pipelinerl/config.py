"""Structured configuration: one dataclass per component, merged from defaults, a recipe YAML and CLI overrides.

A run never starts half-configured: unknown keys, wrong types, bad values and missing required values all
fail in `load_config` with a `ConfigError` that names the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelinerl.plugins import ENGINES, TASKS

BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
STREAM_BACKENDS = ("files", "redis")
CURRICULA = ("learnability", "unsolved")  # actor.curriculum (pipelinerl/tasks/curriculum.py)
REDIS_SCHEMES = ("redis", "rediss", "unix")


class ConfigError(ValueError):
    """A configuration problem, with the offending key and its source in the message."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _check_choice(value: str, choices: tuple[str, ...], key: str) -> None:
    _check(value in choices, key, f"must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class ModelConfig:
    path: str = MISSING  # local directory with a Hugging Face model (or a hub name where a hub is reachable)
    # the weights the engines serve and the trainer sends them; auto: bfloat16 where the launcher finds GPUs,
    # float32 without (`resolve_for_machine`)
    dtype: str = "auto"
    # "pretrained" loads `path`; "tiny" builds a small random model there first if it does not exist yet
    init: str = "pretrained"
    tiny_hidden_size: int = 64
    tiny_layers: int = 2
    # the tiny model's tokenizer: "char" (one token per character) or "bpe" (byte-level BPE trained on the task's
    # training texts, tiny_vocab_size tokens: long prompts such as ORZ's template stay short)
    tiny_tokenizer: str = "char"
    tiny_vocab_size: int = 1024
    # supervised warm-up of a "tiny" model on the task's training set, so RL starts from a non-zero success rate
    warmup_steps: int = 0
    warmup_lr: float = 3e-3
    warmup_batch_size: int = 64
    # the seed the tiny model is built and warmed up with; null: the run's `seed`. Set it to rerun RL with another
    # seed from the same cached base model (a changed seed would otherwise build and warm up a new one)
    seed: Optional[int] = None  # noqa: UP045 (omegaconf needs Optional)
    # each prompt as one user turn of the tokenizer's chat template, with its generation prompt (instruction-tuned
    # and distilled models: DeepSeek-R1-Distill's "<｜User｜>...<｜Assistant｜><think>"); false: the task's text as
    # it is (base models, ORZ's template)
    chat_template: bool = False

    def __post_init__(self) -> None:
        _check_choice(self.dtype, DTYPES, "model.dtype")
        _check_choice(self.init, ("pretrained", "tiny"), "model.init")
        _check_choice(self.tiny_tokenizer, ("char", "bpe"), "model.tiny_tokenizer")
        _check(self.tiny_vocab_size >= 300, "model.tiny_vocab_size", "must be at least 300 (256 bytes + specials)")


@dataclass
class EngineConfig:
    kind: str = "embedded"  # embedded | vllm | sglang (pipelinerl.plugins.ENGINES), or package.module:KIND of your own
    # engines per node, one GPU each on GPU machines; 0 there fills the node: one engine per GPU the trainer
    # does not use
    num_engines: int = 1
    # bind address; multi-node runs need one that node 0 can reach (0.0.0.0 or the node's address)
    host: str = "127.0.0.1"
    # 0: each engine binds a free port and reports it (no clashes between runs); N: engine i listens on N + i
    base_port: int = 0
    max_running_seqs: int = 64  # sequences decoded together; more wait in the queue
    max_batch_tokens: int = 16384  # KV-cache tokens held by running sequences
    max_model_len: int = 512  # prompt + generated tokens per sequence
    threads: int = 1  # CPU threads for the engine's torch ops
    # GPU engines: the fraction of each engine GPU the engine may take (vLLM --gpu-memory-utilization, SGLang
    # --mem-fraction-static); weights, activations and KV cache come out of it
    gpu_memory_utilization: float = 0.9
    # engines on the trainer's GPUs instead of GPUs of their own (a one-GPU workstation); give the trainer room
    # by lowering gpu_memory_utilization
    colocate_with_trainer: bool = False
    # GPUs per engine, split by tensor parallelism (vLLM --tensor-parallel-size, SGLang --tp-size); every one of
    # an engine's workers is a rank of the weight-update group. The embedded engine runs on one device.
    tensor_parallel_size: int = 1
    # An engine that dies is restarted by its launcher, up to max_restarts times each (0: a dead engine stops the
    # run); the trainer waits up to restart_wait_s for it to come back, then re-forms the weight-update group and
    # gives it the current weights; the actor sends the dead engine's requests to the others meanwhile
    max_restarts: int = 3
    restart_wait_s: float = 900.0
    # seconds an engine may take from its start until it answers its health check: reading the weights, vLLM's
    # compilation and CUDA graphs. Unset: sized from the model's weights per engine (at least 900 s; `pipelinerl
    # plan` prints it), so that 32B engines reading from shared storage are not given up on while they load
    start_timeout_s: Optional[float] = None  # noqa: UP045 (omegaconf needs Optional)

    def __post_init__(self) -> None:
        _check(ENGINES.knows(self.kind), "engine.kind", f"must be one of {ENGINES.choices()}, got {self.kind!r}")
        _check(self.start_timeout_s is None or self.start_timeout_s > 0, "engine.start_timeout_s",
               "must be > 0 (seconds), or unset to size it from the model")
        _check(self.max_restarts >= 0, "engine.max_restarts", "must be >= 0 (0: a dead engine stops the run)")
        _check(self.restart_wait_s > 0, "engine.restart_wait_s", "must be > 0")
        _check(self.tensor_parallel_size >= 1, "engine.tensor_parallel_size", "must be at least 1")
        _check(self.tensor_parallel_size == 1 or _engine_kind(self.kind).tensor_parallel,
               "engine.tensor_parallel_size", f"the {self.kind} engine runs on one device; use an engine kind with "
               "tensor parallelism (vllm, sglang)")
        _check(0 < self.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization", "must be in (0, 1]")
        _check(self.num_engines >= 0, "engine.num_engines", "must be >= 0 (0: fill the node's free GPUs)")
        _check(0 <= self.base_port <= 65535, "engine.base_port", "must be a TCP port, or 0 for any free one")
        _check(self.max_running_seqs >= 1, "engine.max_running_seqs", "must be at least 1")
        _check(self.max_model_len >= 2, "engine.max_model_len", "must be at least 2")
        _check(self.max_batch_tokens >= self.max_model_len, "engine.max_batch_tokens",
               "must be at least engine.max_model_len so one full sequence fits")


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # of the engines' sampling; the trainer's log-probs take the same (trainer.temperature)
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 64  # output tokens per attempt; an output cut there has finish_reason "length"
    group_size: int = 8  # attempts per prompt (G)
    # strings that end a generation, kept in the output (ORZ: "</answer>", "User:", ...; the contract's
    # `sampling.stop`: the token that completes one is the last one returned)
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "sampling.temperature", "must be >= 0")
        _check(all(isinstance(s, str) and s for s in self.stop), "sampling.stop", "stop strings must not be empty")
        _check(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "sampling.top_k", "must be >= 0")
        _check(self.max_new_tokens >= 1, "sampling.max_new_tokens", "must be at least 1")
        _check(self.group_size >= 1, "sampling.group_size", "must be at least 1")


@dataclass
class WeightSyncConfig:
    # nccl | gloo | auto. A run config's is auto (RunConfig.weight_sync), which the launcher resolves: nccl where
    # it finds GPUs (gloo when engines share the trainer's GPUs), gloo without. gloo for one made in code.
    backend: str = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0: the trainer picks a free port when it forms the group (engines learn it over HTTP)
    group_name: str = "weight_update"
    # 0: one broadcast per tensor. 4 MB: tensors of that size or more go out alone, with no packing copy, and the
    # small ones are still grouped (docs/benchmarks.md, section "Weight sync through the trainer's path"). A run
    # config's is unset (RunConfig.weight_sync): 4, or 0 for engine.kind sglang, which receives one tensor per
    # broadcast.
    bucket_mb: Optional[float] = 4.0  # noqa: UP045 (omegaconf needs Optional, not `float | None`)
    timeout_s: float = 120.0
    # SGLang holds every tensor of one update call on its GPU at once, so its front splits an update into calls
    # of at most this many MiB (headroom the engine's GPU needs beside engine.gpu_memory_utilization)
    sglang_update_chunk_mb: float = 1024.0

    def __post_init__(self) -> None:
        _check_choice(self.backend, BACKENDS, "weight_sync.backend")
        _check(0 <= self.master_port <= 65535, "weight_sync.master_port", "must be a TCP port, or 0 for any free one")
        _check(bool(self.group_name), "weight_sync.group_name", "must not be empty")
        _check(self.bucket_mb is None or self.bucket_mb >= 0, "weight_sync.bucket_mb", "must be >= 0")
        _check(self.timeout_s > 0, "weight_sync.timeout_s", "must be > 0")
        _check(self.sglang_update_chunk_mb > 0, "weight_sync.sglang_update_chunk_mb",
               "must be > 0 (MiB per update call to SGLang; 1024 is a good size)")


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (`trainer.advantage: gae`, ORZ's method): the policy's base model with a
    scalar head, trained on the returns with its own AdamW."""

    lr: float = 5e-6  # ORZ critic_learning_rate
    # optimizer updates per batch: one pass over it in this many parts (ORZ critic_update_steps: 12); each trainer
    # rank splits its own share of the batch
    updates: int = 1
    value_clip: Optional[float] = 0.2  # noqa: UP045 (values kept within this of the pre-update ones; unset: off)
    gamma: float = 1.0  # GAE discount (ORZ: 1)
    lam: float = 1.0  # GAE lambda (ORZ: 1)
    # advantages normalised to mean 0, std 1 over the batch's tokens (ORZ, OpenRLHF's advantage normalisation)
    whiten_advantages: bool = True
    # the critic's learning rate rises linearly to `lr` over its first this-many optimizer updates (`updates` per
    # trainer step), then stays: ORZ's constant schedule with 50 warm-up steps of its critic's optimizer, about 4
    # trainer steps at 12 updates each; 0: constant from the start
    warmup_updates: int = 0
    # each step's critic updates take the batch's samples in a seeded random order (ORZ's DataLoader(shuffle=True));
    # false: contiguous slices in packing order (longest first), one length band per update
    shuffle: bool = True
    # the first this-many steps train the critic only, the policy frozen (verl's critic_warmup): its first policy
    # updates then get values fitted to the task instead of a zero head. The steps count as versions (the engines
    # sample the same weights) and in the policy's learning-rate schedule
    policy_frozen_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "trainer.critic.lr", "must be > 0")
        _check(self.updates >= 1, "trainer.critic.updates", "must be at least 1")
        _check(self.value_clip is None or self.value_clip > 0, "trainer.critic.value_clip", "must be > 0 or unset")
        _check(0 <= self.gamma <= 1, "trainer.critic.gamma", "must be in [0, 1]")
        _check(0 <= self.lam <= 1, "trainer.critic.lam", "must be in [0, 1]")
        _check(self.warmup_updates >= 0, "trainer.critic.warmup_updates", "must be >= 0 (0: no warm-up)")
        _check(self.policy_frozen_steps >= 0, "trainer.critic.policy_frozen_steps", "must be >= 0 (0: none)")


@dataclass
class TrainerConfig:
    lr: float = 1e-6  # the policy's AdamW learning rate (after warm-up; the schedule's peak)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's
    weight_decay: float = 0.0  # AdamW's
    warmup_steps: int = 0  # steps over which the learning rate rises linearly from 0 to lr
    schedule: str = "constant"  # or cosine
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0: no clipping
    samples_per_step: int = 64  # samples per optimizer step (a multiple of sampling.group_size: whole groups)
    # tokens per packed micro-batch of the trainer's forward and backward passes (at least engine.max_model_len)
    micro_batch_tokens: int = 4096
    # RL algorithm: names registered in pipelinerl/rl/losses.py and advantages.py (pipelinerl/rl/registry.py), or a
    # function of your own as package.module:function. docs/algorithms.md lists each one's keys.
    policy_loss: str = "reinforce_is"  # reinforce_is | ppo_clip | decoupled_ppo | gspo
    policy_loss_args: dict[str, Any] = field(default_factory=dict)  # for a policy loss of your own
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp_baseline | gae (PPO with trainer.critic)
    # token_sum_norm | token_mean | seq_mean; unset: the loss's own (gspo: seq_mean, others: token_sum_norm)
    aggregation: Optional[str] = None  # noqa: UP045 (omegaconf needs Optional)
    # PPO trust region; unset: the loss's own (0.2 / 0.28, clip-higher; gspo: 3e-4 / 4e-4)
    clip_low: Optional[float] = None  # noqa: UP045
    clip_high: Optional[float] = None  # noqa: UP045
    # dual-clip PPO: where A < 0 the loss is at most -clip_ratio_c * A (3 in verl and the paper); unset: off
    clip_ratio_c: Optional[float] = None  # noqa: UP045
    # optimizer updates per batch, each on 1/ppo_minibatches of it (AReaL's ppo_n_minibatches); the weights are
    # published once, after the last. decoupled_ppo's proximal policy is the one before the first.
    ppo_minibatches: int = 1
    # decoupled_ppo, gspo: tokens whose behaviour weight pi_prox / pi_behav exceeds this are left out of the loss
    # (AReaL's behav_imp_weight_cap); unset: the loss's own (decoupled_ppo: 5, AReaL's; gspo: none); 0: none
    behav_imp_weight_cap: Optional[float] = None  # noqa: UP045
    importance_sampling_level: str = "token"  # decoupled_ppo: token | sequence (a geometric-mean ratio per sample)
    is_cap: float = 5.0  # reinforce_is: importance weights are capped here (truncated IS)
    group_std_unbiased: bool = False  # grpo: the group std with n - 1 (verl, TRL) instead of n
    whiten_over: str = "samples"  # reinforce_pp_baseline: normalise over the batch's samples or tokens (OpenRLHF)
    # DAPO / PipelineRL: samples cut off by the length limit are left out of the loss (they stay in their group's
    # baseline)
    overlong_filtering: bool = False
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef times the mean token entropy
    # Samples whose advantage is 0 (a group whose answers all got the same reward, under grpo and the like) add
    # nothing to the gradient: leave them out of the trainer's forward and backward passes. The update is the same
    # (the loss's denominators still count them); the per-token stats (entropy, clip fractions, IS weights) then
    # cover the samples passed through. Applies where nothing else needs those samples: a loss registered
    # zero_without_advantage (all built-in ones), per-sample advantages (not gae), no KL term, no entropy bonus.
    skip_zero_advantage: bool = True
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # KL in the reward (REINFORCE++, OpenRLHF's use_kl_loss false) instead of a loss term; how it is charged:
    kl_in_reward: bool = False
    # with kl_in_reward, how a per-sample estimator charges the KL: `sample`, the sample's reward minus kl_coef times
    # its summed KL before the advantages, every token charged the whole sample's KL (verl's use_kl_in_reward with
    # GRPO); `to_go`, each token's advantage minus kl_coef times the KL of it and the tokens after it, its
    # reward-to-go (OpenRLHF's REINFORCE++ and REINFORCE++-baseline, which whiten afterwards: whiten_over tokens).
    # Unset: sample; gae charges each token its own KL and takes the returns, always to_go
    kl_reward: Optional[str] = None  # noqa: UP045
    # the KL coefficient over the run: constant; linear from kl_coef to kl_coef_end over kl_schedule_steps; or
    # adaptive (Ziegler et al.: moved towards kl_target, horizon kl_horizon samples)
    kl_schedule: str = "constant"
    kl_coef_end: float = 0.0
    kl_schedule_steps: int = 0
    kl_target: float = 0.01
    kl_horizon: int = 10000
    ref_reset_every: int = 0  # ProRL: the KL reference becomes the current policy every N steps; 0 = never
    ref_reset_kl: Optional[float] = None  # noqa: UP045 (and whenever the step's mean KL exceeds this)
    # (and after this many held-out evaluations without a new best eval_accuracy; 0 = never)
    ref_reset_patience: int = 0
    ref_reset_optimizer: bool = False  # ProRL v1: a reference reset also resets the optimizer's state
    # PPO with a value model (advantage: gae, ORZ's method); unused otherwise
    critic: CriticConfig = field(default_factory=CriticConfig)
    max_steps: int = 100
    # Checkpoints (RUN_DIR/checkpoints; a rerun of the same command resumes from the newest): every save_every
    # steps (0: off), and whenever save_every_minutes have passed since the last one (0: off), so a killed run
    # loses at most that much; also on SIGTERM, SIGINT and SIGUSR1 (SLURM's pre-emption warning), before exiting,
    # and at the end. The newest keep_checkpoints are kept (0: all).
    save_every: int = 0
    save_every_minutes: float = 30.0
    keep_checkpoints: int = 2
    # seconds the launcher, when stopped (Ctrl-C, SIGTERM), gives the trainer to save its checkpoint and exit
    # before killing it
    stop_grace_s: float = 300.0
    eval_every: int = 0  # held-out evaluation every N steps (and before the first and after the last); 0 = off
    # a Hugging Face export of the policy (as final_model) to RUN_DIR/exports/step_<N> every N steps and after the
    # last; 0 = off. Each loads in any engine, `pipelinerl eval --model` or another harness, so a run can be
    # evaluated after it ends, off its clock and without the engines' time (bench/vs_trl.py does so)
    export_every: int = 0
    eval_k: int = 4  # samples per held-out problem (pass@1 is averaged over them)
    eval_greedy: bool = False  # one greedy sample per problem instead
    threads: int = 1  # CPU threads per trainer process
    # trainer processes in all (accelerate's --num_processes; the world that ZeRO-3/FSDP shard over): one per GPU on
    # GPU machines, trainer.num_processes / trainer.num_nodes on the first GPUs of each trainer node; on CPU, more
    # than 1 is data parallel over gloo
    num_processes: int = 1
    # nodes the trainer spans: nodes 0 .. num_nodes-1 of a multi-node run (WORLD_SIZE), each running an equal share
    # of num_processes, with engines on their other GPUs; global rank 0 (on node 0) alone talks to the engines
    num_nodes: int = 1
    # an accelerate config (configs/accelerate/*.yaml: DeepSpeed ZeRO-3, FSDP) used when num_processes > 1;
    # empty: plain data parallel (DDP)
    accelerate_config: str = ""
    temperature: float = 1.0  # the sampling temperature: trainer log-probs use logits / temperature, as the engine
    mixed_precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU | no | bf16
    # auto | sdpa | eager | flash_attention_2 (GPU; setup.cfg's `flash` extra, which `make install` adds on GPU
    # machines). sdpa and eager run a micro-batch as right-padded rows where that is cheaper, else as one packed row
    # under a dense micro_batch_tokens^2 mask (bool + sdpa's bf16 copy: 3 B per pair, 0.75 GiB at 16k tokens);
    # flash-attention builds no mask (varlen kernel on the rows' cu_seqlens).
    # auto: flash_attention_2 on GPUs where flash-attn imports (else sdpa, with a warning), sdpa on CPU.
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    # how a CPU trainer multiplies its float32 linear layers (forward and backward): auto | blas | onednn. auto
    # times both kernels on the model's weight shapes at start-up and takes oneDNN where it is faster: torch's
    # BLAS (MKL) runs AVX2 code on AMD CPUs, where oneDNN's AVX-512 kernels make a step faster (docs/benchmarks.md,
    # section "The trainer's matmuls through oneDNN"). Sharded (ZeRO-3, FSDP) and GPU trainers always use torch's
    # own path.
    linear_kernel: str = "auto"
    # a group's samples in one micro-batch share their prompt where that costs less: the prompt goes through the
    # model once, its completions after it under a mask (sdpa, eager; never with flash-attention or a critic). The
    # same log-probs and gradients; short answers to long prompts (the tiny recipe) train in ~40% of the tokens
    share_prompts: bool = True
    # tokens per chunk of the LM head when computing log-probs and entropy: only [chunk, vocab] float32 logits
    # exist at a time (two such buffers in the forward, one in the backward, which recomputes them), never
    # [micro_batch_tokens, vocab]. 1024 x 152064 vocab: 0.62 GB per buffer.
    logprob_chunk_tokens: int = 1024
    # seconds one collective of the trainer processes (all-reduce, ZeRO-3 gather, barrier) may take before the
    # run fails naming it (NCCL's watchdog ends the process; gloo raises). Work the main process does alone is
    # not waited for inside a collective (see main_process_timeout_s), so this only has to cover real collectives
    collective_timeout_s: float = 1800.0
    # seconds the other trainer processes wait, on the host and outside any collective, for work the main process
    # does alone (held-out evaluation, pushing weights to the engines, checkpoint and export files) before the
    # run fails saying the main process never came
    main_process_timeout_s: float = 14400.0
    # a step whose loss or gradient norm is not finite (NaN/inf, on any trainer process) is skipped on every process,
    # weights and optimizer state untouched, and counted (`skipped` in metrics.jsonl); after this many skipped in a
    # row the trainer stops the run (resumable from its last checkpoint) instead of training on nothing
    max_skipped_steps: int = 5

    def __post_init__(self) -> None:
        _check(self.max_skipped_steps >= 1, "trainer.max_skipped_steps", "must be at least 1")
        _check(self.lr > 0, "trainer.lr", "must be > 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas",
               "must be two numbers in [0, 1)")
        _check_choice(self.schedule, ("constant", "cosine"), "trainer.schedule")
        _check_choice(self.linear_kernel, ("auto", "blas", "onednn"), "trainer.linear_kernel")
        self._check_algorithm()
        _check_choice(self.kl_estimator, ("k1", "k2", "k3"), "trainer.kl_estimator")
        _check(self.ppo_minibatches >= 1, "trainer.ppo_minibatches", "must be at least 1")
        _check(self.clip_low is None or 0 <= self.clip_low < 1, "trainer.clip_low", "must be in [0, 1) or unset")
        _check(self.clip_high is None or self.clip_high >= 0, "trainer.clip_high", "must be >= 0 or unset")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1, "trainer.clip_ratio_c",
               "must be > 1 (3 is usual), or unset for no dual-clip")
        _check(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1 or self.behav_imp_weight_cap == 0,
               "trainer.behav_imp_weight_cap",
               "must be > 1 (a cap of w = pi_prox / pi_behav; AReaL uses 5 or more), 0 for none, or unset for the "
               "loss's own")
        _check_choice(self.importance_sampling_level, ("token", "sequence"), "trainer.importance_sampling_level")
        _check_choice(self.whiten_over, ("samples", "tokens"), "trainer.whiten_over")
        _check(self.is_cap > 0, "trainer.is_cap", "must be > 0")
        _check(self.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0")
        _check(self.kl_coef >= 0, "trainer.kl_coef", "must be >= 0")
        _check_choice(self.kl_schedule, ("constant", "linear", "adaptive"), "trainer.kl_schedule")
        _check(self.kl_schedule != "linear" or self.kl_schedule_steps >= 1, "trainer.kl_schedule_steps",
               "must be at least 1 with trainer.kl_schedule linear (steps from kl_coef to kl_coef_end)")
        _check(self.kl_coef_end >= 0, "trainer.kl_coef_end", "must be >= 0")
        _check(self.kl_target > 0 and self.kl_horizon >= 1, "trainer.kl_target",
               "kl_target must be > 0 and kl_horizon at least 1")
        _check(not self.kl_in_reward or self.kl_coef > 0, "trainer.kl_in_reward",
               "needs trainer.kl_coef > 0 (the weight of the KL in the reward)")
        _check(self.ref_reset_every >= 0, "trainer.ref_reset_every", "must be >= 0 (0: never)")
        _check(self.ref_reset_kl is None or self.ref_reset_kl > 0, "trainer.ref_reset_kl", "must be > 0 or unset")
        _check(self.ref_reset_patience >= 0, "trainer.ref_reset_patience", "must be >= 0 (0: never)")
        resets = self.ref_reset_every or self.ref_reset_kl is not None or self.ref_reset_patience
        _check(not resets or self.kl_coef > 0, "trainer.kl_coef",
               "is 0, so there is no KL reference to reset (trainer.ref_reset_every / ref_reset_kl / "
               "ref_reset_patience); set trainer.kl_coef > 0 or leave the resets off")
        _check(self.samples_per_step >= 1, "trainer.samples_per_step", "must be at least 1")
        _check(self.max_steps >= 1, "trainer.max_steps", "must be at least 1")
        _check(self.save_every >= 0, "trainer.save_every", "must be >= 0 (0: no checkpoint by step count)")
        _check(self.save_every_minutes >= 0, "trainer.save_every_minutes", "must be >= 0 (0: none by time)")
        _check(self.keep_checkpoints >= 0, "trainer.keep_checkpoints", "must be >= 0 (0: keep all)")
        _check(self.export_every >= 0, "trainer.export_every", "must be >= 0 (0: no exports during the run)")
        _check(self.stop_grace_s > 0, "trainer.stop_grace_s", "must be > 0")
        _check(self.temperature > 0, "trainer.temperature", "must be > 0 (log-probs of greedy decoding are undefined)")
        _check_choice(self.mixed_precision, ("auto", "no", "bf16"), "trainer.mixed_precision")
        _check(self.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be at least 1")
        _check(self.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens",
               "must be at least 1 (tokens per chunk of the LM head; 1024 is a good size on GPUs)")
        _check(self.num_processes >= 1, "trainer.num_processes", "must be at least 1")
        _check(self.num_nodes >= 1, "trainer.num_nodes", "must be at least 1")
        _check(self.num_processes % self.num_nodes == 0, "trainer.num_processes",
               f"{self.num_processes} processes do not divide evenly over trainer.num_nodes {self.num_nodes} (it "
               "counts the processes of all trainer nodes); make it a multiple of trainer.num_nodes")
        _check(self.collective_timeout_s > 0, "trainer.collective_timeout_s", "must be > 0")
        _check(self.main_process_timeout_s > 0, "trainer.main_process_timeout_s", "must be > 0")
        _check(self.accelerate_config == "" or Path(self.accelerate_config).is_file(), "trainer.accelerate_config",
               f"no such file {self.accelerate_config!r} (see configs/accelerate/)")


    def _check_algorithm(self) -> None:
        """The algorithm's names must be in the registry (or importable functions)."""
        from pipelinerl.rl import registry

        try:
            registry.policy_loss(self.policy_loss)
        except KeyError as e:
            raise ConfigError(f"trainer.policy_loss: {e.args[0]}") from None
        try:
            registry.advantage(self.advantage)
        except KeyError as e:
            raise ConfigError(f"trainer.advantage: {e.args[0]}") from None
        _check(self.aggregation is None or self.aggregation in registry.AGGREGATIONS, "trainer.aggregation",
               f"must be one of {', '.join(registry.AGGREGATIONS)} or unset, got {self.aggregation!r}")
        self._check_algorithm_keys()
        self._check_kl_reward()

    def _check_algorithm_keys(self) -> None:
        """A setting of one algorithm under another would be silently ignored: refuse it, naming who reads it."""
        from pipelinerl.rl import registry

        loss, adv = registry.policy_loss(self.policy_loss), registry.advantage(self.advantage)
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(TrainerConfig)}
        for key in registry.ALGORITHM_KEYS:
            value = getattr(self, key)
            if value == defaults[key] or registry.reads_key(loss, key) or registry.reads_key(adv, key):
                continue
            readers = registry.readers(key)
            by = f"; it is read by {', '.join(readers)}" if readers else " (only a loss of your own reads it)"
            shown = "set" if key == "critic" else f"{value!r}"
            raise ConfigError(f"trainer.{key}: {shown}, but trainer.policy_loss {self.policy_loss} and "
                              f"trainer.advantage {self.advantage} do not read it, so it would have no effect{by}. "
                              "Remove it from the recipe or choose an algorithm that reads it; to change a recipe's "
                              "algorithm on the command line, name a preset (preset=NAME, recipes/presets/), which "
                              "replaces the recipe's algorithm settings")

    def _check_kl_reward(self) -> None:
        from pipelinerl.rl import registry

        if self.kl_reward is None:
            return
        _check_choice(self.kl_reward, ("sample", "to_go"), "trainer.kl_reward")
        _check(self.kl_in_reward, "trainer.kl_reward",
               f"{self.kl_reward!r} has no effect without trainer.kl_in_reward (the KL is then a loss term); set "
               "trainer.kl_in_reward=true or remove it")
        adv = registry.advantage(self.advantage)
        _check(not (adv.token_level and self.kl_reward == "sample"), "trainer.kl_reward",
               f"'sample' cannot apply to {self.advantage}, which charges each token its own KL and takes the returns "
               "(to_go); remove it")
        _check(not (adv.whitened and self.kl_reward == "to_go" and self.whiten_over == "samples"),
               "trainer.whiten_over", f"is samples, but with trainer.kl_reward to_go {self.advantage} whitens "
               "per-token advantages (OpenRLHF's REINFORCE++): set trainer.whiten_over=tokens")

    def with_algorithm_defaults(self) -> TrainerConfig:
        """This config with the settings left unset filled in from the chosen policy loss (GSPO's clip range and
        sequence-mean aggregation, the PPO family's 0.2 / 0.28 and token_sum_norm). The trainer runs on this."""
        from pipelinerl.rl import registry

        loss = registry.policy_loss(self.policy_loss)
        filled = {key: value for key, value in loss.defaults.items() if getattr(self, key) is None}
        if registry.reads_key(loss, "clip_low") and self.clip_low is None:
            filled["clip_low"] = loss.clip[0]
        if registry.reads_key(loss, "clip_high") and self.clip_high is None:
            filled["clip_high"] = loss.clip[1]
        kl_reward = self.kl_reward
        if self.kl_in_reward and kl_reward is None:
            kl_reward = "to_go" if registry.advantage(self.advantage).token_level else "sample"
        return dataclasses.replace(self, **filled, kl_reward=kl_reward,
                                   aggregation=loss.aggregation if self.aggregation is None else self.aggregation)


@dataclass
class ActorConfig:
    max_lag: int = 4  # versions; 0 is synchronous RL
    # one-step off-policy RL (verl's and TRL's asynchronous mode), a baseline to compare pipelining against: whole
    # batches, each generated by one version (batch k+1 by the weights trained on batch k-1, while the trainer
    # trains on batch k); the trainer sends new weights only once the next batch is generated, so no update lands
    # mid-batch. Needs max_lag: 1
    one_step_off_policy: bool = False
    concurrency: int = 32  # requests in flight per engine
    # drop a group whose samples are all right or all wrong (`reward_parts["correct"]`, as DAPO and verl filter on
    # accuracy): it has no correctness signal, even where length shaping makes its rewards differ
    dynamic_sampling: bool = True
    # under dynamic sampling, a problem whose group comes back all right is retired from the training pool and not
    # sampled again (ProRL's and DAPO's pruning of solved prompts); once every problem is retired the run ends, exit 0
    retire_solved: bool = True
    # under dynamic sampling, stop the run once this many groups in a row came back all wrong: a policy that gets
    # nothing right any more gives no signal, and regenerating would go on forever (DAPO's max_num_gen_batches).
    # All-right groups neither count nor reset it (their problems are retired). The run ends as a success instead
    # where what is left is out of the policy's reach rather than forgotten: at most half as many problems as the
    # groups dropped are left unretired, or at each problem's recent pass rate fewer than 3 of those groups'
    # answers would have been right (COLLAPSE_EXPECTED_RIGHT in pipelinerl/actor.py). None: ten steps' worth of groups
    # (10 * samples_per_step / group_size); 0: never stop
    max_dropped_in_a_row: Optional[int] = None  # noqa: UP045 (omegaconf needs Optional)
    # a curriculum over the task's domains (a mix's, Reasoning Gym's generators; pipelinerl/tasks/curriculum.py): each
    # group's domain drawn by its weight times a factor of its pass rate p among the answers generated.
    # "learnability": 4p(1-p), most where a group's answers differ most; "unsolved": 1-p, fading solved domains.
    # null: the task's own shares, in a seeded order
    curriculum: Optional[str] = None  # noqa: UP045 (omegaconf needs Optional)
    curriculum_floor: float = 0.1  # the least factor a domain gets: none starves, its pass rate is still measured
    curriculum_smoothing: float = 0.05  # each group's weight in its domain's moving-average pass rate

    def __post_init__(self) -> None:
        _check(self.max_lag >= 0, "actor.max_lag", "must be >= 0")
        _check(not self.one_step_off_policy or self.max_lag == 1, "actor.one_step_off_policy",
               f"trains each batch one version after the weights that generated it: set actor.max_lag: 1 (got "
               f"{self.max_lag}), or actor.one_step_off_policy: false")
        _check(self.max_dropped_in_a_row is None or self.max_dropped_in_a_row >= 0, "actor.max_dropped_in_a_row",
               f"must be >= 0 (0: no limit) or null, got {self.max_dropped_in_a_row}")
        _check(self.concurrency >= 1, "actor.concurrency", "must be at least 1")
        _check(self.curriculum is None or self.curriculum in CURRICULA, "actor.curriculum",
               f"must be one of {', '.join(CURRICULA)} or null, got {self.curriculum!r}")
        _check(0 < self.curriculum_floor <= 1, "actor.curriculum_floor",
               f"must be in (0, 1], got {self.curriculum_floor}")
        _check(0 < self.curriculum_smoothing <= 1, "actor.curriculum_smoothing",
               f"must be in (0, 1], got {self.curriculum_smoothing}")


@dataclass
class RewardConfig:
    workers: int = 1  # reward worker processes
    timeout_s: float = 5.0  # seconds one answer's check may take; past that it scores 0 and is counted
    # how far a reward worker's memory (address space) may grow beyond its imports; a check that needs more scores
    # 0, is counted (reward_out_of_memory) and its worker replaced. 0: no limit
    memory_limit_mb: int = 4096
    # length shaping (pipelinerl.rewards.shaping); all off by default
    truncated_zero: bool = False  # Open-Reasoner-Zero: outputs cut off by the length limit earn 0
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens before the limit; 0 = off
    overlong_penalty: float = 1.0  # penalty reached at the limit
    cosine_length: bool = False  # cosine length-scaled reward (Yeo et al. 2025, ProRL v2)
    cosine_r_correct_short: float = 2.0
    cosine_r_correct_long: float = 1.0
    cosine_r_wrong_short: float = -10.0
    cosine_r_wrong_long: float = 0.0
    # what an output cut off by the length limit (finish_reason "length") gets while the cosine reward is on,
    # right or wrong (the paper's exceed-length penalty); null: it scores by its length like any other output
    cosine_r_exceed: Optional[float] = -10.0  # noqa: UP045 (omegaconf needs Optional)
    cosine_on_steps: int = 0  # with cosine_off_steps > 0: on for this many trainer steps, then off, repeating
    cosine_off_steps: int = 0  # 0 = the cosine reward is always on (when cosine_length is set)

    def __post_init__(self) -> None:
        _check(self.workers >= 1, "reward.workers", "must be at least 1")
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _check(self.overlong_buffer >= 0, "reward.overlong_buffer", "must be >= 0")
        _check(self.overlong_penalty >= 0, "reward.overlong_penalty", "must be >= 0")
        _check(self.memory_limit_mb >= 0, "reward.memory_limit_mb", "must be >= 0 (0: no limit)")
        _check(self.cosine_on_steps >= 0, "reward.cosine_on_steps", "must be >= 0")
        _check(self.cosine_off_steps >= 0, "reward.cosine_off_steps", "must be >= 0")


@dataclass
class EvalConfig:
    """Sampling for held-out evaluation (the trainer's periodic one), independent of training's. A value left
    unset (null) takes the training one from `sampling`. `trainer.eval_every` and `trainer.eval_k` say when and
    how many samples per problem."""

    temperature: Optional[float] = None  # noqa: UP045 (omegaconf needs Optional, not `float | None`)
    top_p: Optional[float] = None  # noqa: UP045 (null: sampling.top_p)
    max_new_tokens: Optional[int] = None  # noqa: UP045 (null: sampling.max_new_tokens)
    # stop strings for evaluation; null: the training ones (`sampling.stop`)
    stop: Optional[list[str]] = None  # noqa: UP045

    def __post_init__(self) -> None:
        _check(self.temperature is None or self.temperature >= 0, "eval.temperature", "must be >= 0")
        _check(self.top_p is None or 0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1]")
        _check(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", "must be at least 1")


@dataclass
class ResourcesConfig:
    """What a recipe needs. The launcher checks it against the machine before anything starts (a 7B recipe on a
    laptop stops within seconds, saying what it needs); `pipelinerl plan` uses it as the default cluster."""

    nodes: int = 1  # machines the run spans (each runs `pipelinerl run` with WORLD_SIZE/RANK set, or via SLURM)
    gpus_per_node: int = 0  # 0: a CPU recipe, runs anywhere
    gpu_memory_gib: float = 0.0  # memory per GPU the recipe was planned for (`pipelinerl plan`); 0: not stated

    def __post_init__(self) -> None:
        _check(self.nodes >= 1, "resources.nodes", "must be at least 1")
        _check(self.gpus_per_node >= 0, "resources.gpus_per_node", "must be >= 0 (0: a CPU recipe)")
        _check(self.gpu_memory_gib >= 0, "resources.gpu_memory_gib", "must be >= 0")




@dataclass
class TaskConfig:
    # a registered task (arithmetic | math | code | counting | reasoning_gym | ifeval | mix ..., see
    # pipelinerl.tasks and docs/configuration.md "Tasks and domains") or your own as "package.module:Class" (any
    # callable returning a task): a new task is one file, no registry
    name: str = "arithmetic"
    # the task's own settings, passed to it as keyword arguments; each task's docstring lists them. Arithmetic:
    # digits, ops, reverse, num_train, num_eval, mul_digits. Math: train_data, eval_data (local JSON/JSONL files in
    # ORZ or plain format, or Hugging Face dataset names "name" / "name:split"), template (orz | boxed | plain),
    # reward (math | orz | orz_exact; empty = orz for the orz template, math otherwise; problems with `choices`
    # are scored as multiple choice whatever it says), accept_unclosed_answer (the ORZ rules only: score an output
    # that stopped inside an unclosed last <answer> block as if "</answer>" followed; off, ORZ's rule, because the
    # engines here keep stop strings in the output)
    args: dict[str, Any] = field(default_factory=dict)
    # problem generation, given to a task that takes a `seed`; separate from the run seed so held-out sets stay
    # comparable across runs
    seed: int = 0
    reward_fn: str = ""  # "module:function" replacing the task's verifier (importable by the reward workers)

    def __post_init__(self) -> None:
        _check(TASKS.knows(self.name), "task.name",
               f"must be one of {', '.join(TASKS.names())} or a 'package.module:Class' path to your own, got "
               f"{self.name!r}")
        _check(self.reward_fn == "" or ":" in self.reward_fn, "task.reward_fn",
               f"must look like module:function, got {self.reward_fn!r}")
        _check(self.name != "math" or len(self.args.get("train_data") or []) > 0, "task.args.train_data",
               "the math task needs at least one training file or dataset name")


# The settings of the arithmetic and math tasks, once keys of `task:` itself; now under `task.args`. A recipe or an
# override that still writes `task.digits` is read as `task.args.digits`, with a warning, for one release.
LEGACY_TASK_KEYS = ("digits", "ops", "reverse", "num_train", "num_eval", "train_data", "eval_data", "template",
                    "reward", "accept_unclosed_answer")


def _lift_legacy_task_keys(loaded: DictConfig, source: str) -> None:
    """Move `task.<key>` of LEGACY_TASK_KEYS into `task.args.<key>` (in place), warning once per key."""
    task = loaded.get("task")
    if not isinstance(task, DictConfig):
        return
    moved = [key for key in LEGACY_TASK_KEYS if key in task]
    if not moved:
        return
    if "args" not in task or task.args is None:
        task.args = {}
    for key in moved:
        task.args[key] = task.pop(key)
    warnings.warn(f"{source}: {', '.join(f'task.{k}' for k in moved)} -> write "
                  f"{', '.join(f'task.args.{k}' for k in moved)}; the task's settings live under task.args now, and "
                  "the old keys will stop being accepted in the next release", FutureWarning, stacklevel=3)


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # event files in RUN_DIR/tensorboard (needs the `tensorboard` extra)
    wandb_project: str = ""  # a Weights & Biases project to log to (needs the `wandb` extra); empty = off
    wandb_mode: str = "online"  # online | offline | disabled
    # the launcher's progress: a bar on a terminal; elsewhere (a log file, a batch job) one summary line every
    # log_every_s seconds
    log_every_s: float = 30.0

    def __post_init__(self) -> None:
        _check_choice(self.wandb_mode, ("online", "offline", "disabled"), "metrics.wandb_mode")
        _check(self.log_every_s > 0, "metrics.log_every_s", "must be > 0")


@dataclass
class StreamsConfig:
    # files: RUN_DIR/streams on a filesystem that may be shared between nodes; redis: Redis Streams at redis_url
    backend: str = "files"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = ""  # key prefix; empty: pipelinerl:<run_dir name>-<hash of its absolute path>

    def __post_init__(self) -> None:
        _check_choice(self.backend, STREAM_BACKENDS, "streams.backend")
        scheme = urlsplit(self.redis_url).scheme
        _check(scheme in REDIS_SCHEMES, "streams.redis_url",
               f"must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")


@dataclass
class RunConfig:
    run_dir: str = MISSING  # everything of the run goes here: config, logs, streams, checkpoints, metrics, plots
    seed: int = 0  # the trainer's, the actor's and (unless model.seed) the tiny model's
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    weight_sync: WeightSyncConfig = field(default_factory=lambda: WeightSyncConfig(backend="auto", bucket_mb=None))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def __post_init__(self) -> None:
        # A step trains on whole groups: advantages are computed within a group.
        _check(self.trainer.samples_per_step % self.sampling.group_size == 0, "trainer.samples_per_step",
               f"must be a multiple of sampling.group_size ({self.sampling.group_size}), "
               f"got {self.trainer.samples_per_step}")
        _check(self.sampling.max_new_tokens < self.engine.max_model_len, "sampling.max_new_tokens",
               f"must be below engine.max_model_len ({self.engine.max_model_len})")
        if self.weight_sync.bucket_mb is None:  # unset: the engine's best format (SGLang takes one tensor each)
            self.weight_sync.bucket_mb = _engine_kind(self.engine.kind).default_bucket_mb
        self._cross_check()

    def _cross_check(self) -> None:
        """Settings that are each valid alone but wrong together: caught here, before anything starts, instead of
        as a crash (or silently wrong training) hours into a run."""
        t, s, e = self.trainer, self.sampling, self.engine
        # A sample is prompt + output, at most engine.max_model_len tokens; one that does not fit in a micro-batch
        # stops the trainer at its first long sample.
        _check(t.micro_batch_tokens >= e.max_model_len, "trainer.micro_batch_tokens",
               f"{t.micro_batch_tokens} is smaller than the longest sample the engines can produce "
               f"(engine.max_model_len {e.max_model_len}); raise trainer.micro_batch_tokens to at least "
               f"{e.max_model_len} or lower engine.max_model_len")
        _check(self.eval.max_new_tokens is None or self.eval.max_new_tokens < e.max_model_len, "eval.max_new_tokens",
               f"must be below engine.max_model_len ({e.max_model_len})")
        # The trainer scores tokens at trainer.temperature; the engine's behaviour log-probs are at the sampling
        # temperature. Different ones make fresh samples look off-policy: ratios far from 1, clipped and weighted.
        _check(s.temperature == 0 or s.temperature == t.temperature, "trainer.temperature",
               f"{t.temperature} differs from sampling.temperature {s.temperature}: the trainer's log-probs must "
               "use the temperature the engines sample at; set both to the same value")
        backend, gpu = self.weight_sync.backend, self.resources.gpus_per_node > 0
        check_engine = _engine_kind(e.kind).check_config
        if check_engine is not None:
            check_engine(self)
        if e.colocate_with_trainer:
            # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), which is what an
            # engine sharing the trainer's GPU would be; gloo carries the update through host memory instead.
            _check(backend in ("gloo", "auto"), "weight_sync.backend",
                   f"{backend!r} cannot connect a trainer and an engine on the same GPU "
                   "(engine.colocate_with_trainer); set weight_sync.backend=gloo or auto")
        else:
            _check(not gpu or backend in ("nccl", "auto"), "weight_sync.backend",
                   f"{backend!r} is the CPU backend, but this recipe runs on GPUs (resources.gpus_per_node "
                   f"{self.resources.gpus_per_node}); set weight_sync.backend=nccl or auto")
        # A sharded trainer's other processes gather parameters while the main one waits up to weight_sync.timeout_s
        # for the engines to take each bucket: their collective must outlast that wait.
        _check(not t.accelerate_config or t.collective_timeout_s > self.weight_sync.timeout_s,
               "trainer.collective_timeout_s",
               f"{t.collective_timeout_s:g} s must exceed weight_sync.timeout_s ({self.weight_sync.timeout_s:g} s): "
               "the other trainer processes of a sharded trainer sit in a collective while the main one pushes "
               "each bucket of weights to the engines")


def _engine_kind(name: str):
    """The EngineKind of `engine.kind`; a path that does not import, or to something else, names the key."""
    from pipelinerl.contracts.engine import engine_kind

    try:
        return engine_kind(name)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"engine.kind: {e}") from None


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    _lift_legacy_task_keys(other, source)
    task = other.get("task")
    if isinstance(task, DictConfig) and "task" in base and task.get("name", base.task.name) != base.task.name:
        base.task.args = {}  # a task named over another starts from its own settings, not the other's
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{source}: bad key {key!r}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]


PRESETS_DIR = Path(__file__).resolve().parents[1] / "recipes" / "presets"


def preset_names() -> list[str]:
    """The algorithm presets shipped in recipes/presets/ (one per paper's method)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # YAML syntax errors carry the line number in their text
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a {what} must be a mapping of keys")
    return loaded


def _load_presets(value: Any, source: str) -> list[tuple[DictConfig, str]]:
    """`preset: NAME` (or a list of them), each a file of recipes/presets/ or a path to a YAML file."""
    names = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
    out = []
    for name in names:
        path = Path(str(name)) if str(name).endswith((".yaml", ".yml")) else PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"{source}: preset {str(name)!r}: no such preset; available: "
                              f"{', '.join(preset_names())} (or a path to a YAML file)")
        out.append((_load_yaml(path, "preset"), str(path)))
    return out


def _without_algorithm(cfg: DictConfig) -> DictConfig:
    """The recipe's algorithm taken out (its loss, estimator and their settings back to the defaults), for a preset
    named on the command line to replace: loaded onto any recipe, it is that paper's algorithm, not a mix with the
    recipe's (whose clip range, say, would have no effect under the preset's loss and be refused)."""
    from pipelinerl.rl.registry import ALGORITHM_KEYS

    defaults = OmegaConf.structured(TrainerConfig)
    # the KL to a reference and its resets are the algorithm's too (ProRL's): left in, a recipe's reference resets
    # were refused under a preset without KL
    kl = [key for key in defaults if key.startswith(("kl_", "ref_reset"))]
    for key in (*ALGORITHM_KEYS, "policy_loss", "advantage", "aggregation", *kl):
        cfg.trainer[key] = defaults[key]
    return cfg


def load_config(recipe: str | os.PathLike | None = None, overrides: list[str] | None = None,
                schema: type = RunConfig) -> Any:
    """Defaults <- presets the recipe names <- recipe YAML <- presets named on the command line <- dotted overrides
    (`trainer.lr=1e-6`), validated, as a dataclass instance.

    A preset (`recipes/presets/NAME.yaml`: an algorithm as its paper sets it) is named by a top-level `preset:` key
    in the recipe, whose own keys then override it, or by `preset=NAME` on the command line, which overrides the
    recipe; the overrides after it override both."""
    cfg = OmegaConf.structured(schema)
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} does not exist")
        loaded = _load_yaml(path, "recipe")
        if "preset" in loaded:
            for preset, source in _load_presets(loaded.pop("preset"), str(path)):
                cfg = _merge(cfg, preset, source)
        cfg = _merge(cfg, loaded, str(path))
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"command line: override {bad[0]!r} must look like key=value")
        dotlist = OmegaConf.from_dotlist(overrides)
        if "preset" in dotlist:
            if schema is RunConfig:
                cfg = _without_algorithm(cfg)
            for preset, source in _load_presets(dotlist.pop("preset"), "command line"):
                cfg = _merge(cfg, preset, source)
        cfg = _merge(cfg, dotlist, "command line")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        where = f" (set it in {recipe} or on the command line)" if recipe else " (set it on the command line)"
        raise ConfigError(f"missing required value: {', '.join(missing)}{where}")
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError as e:
        source = f"{recipe} / command line" if recipe else "command line"
        raise ConfigError(f"{source}: {e}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad key {getattr(e, 'full_key', '?')!r}: {_first_line(e)}") from None


def resolve_for_machine(cfg: RunConfig, gpus: int) -> tuple[RunConfig, list[str]]:
    """`cfg` with every "auto" setting decided for a node with `gpus` GPUs, and one note per explicit choice that
    the user should hear about. Pure (the launcher passes what `placement.detect_gpus` found), so every node of a
    run decides alike and the rule is tested without a GPU. The result is checked again like any config.

    - `model.dtype`: bfloat16 with GPUs (what engines serve and what goes over the wire), float32 without.
    - `weight_sync.backend`: nccl with GPUs (GPU to GPU), gloo without, and gloo when the engines share the
      trainer's GPUs (`engine.colocate_with_trainer`: NCCL refuses two ranks on one GPU).
    An explicit gloo on a GPU node is kept, with a note saying what it costs."""
    notes: list[str] = []
    dtype, backend = cfg.model.dtype, cfg.weight_sync.backend
    colocated = cfg.engine.colocate_with_trainer
    if dtype == "auto":
        dtype = "bfloat16" if gpus else "float32"
    if backend == "auto":
        backend = "nccl" if gpus and not colocated else "gloo"
    elif backend == "gloo" and gpus:
        why = ("as engine.colocate_with_trainer requires (NCCL refuses two ranks on one GPU)" if colocated
               else "because the config sets it (right where NCCL cannot connect the trainer and the engines; "
                    "leave weight_sync.backend unset, auto, for nccl)")
        notes.append(f"weight_sync.backend=gloo on a node with {gpus} GPU(s): every weight update goes through host "
                     f"memory and TCP, several times slower than nccl's GPU-to-GPU broadcast; kept {why}")
    elif backend == "nccl" and not gpus:
        raise ConfigError("weight_sync.backend: nccl needs GPUs and this node has none; set it to auto or gloo")
    if (dtype, backend) == (cfg.model.dtype, cfg.weight_sync.backend):
        return cfg, notes
    try:
        resolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype),
                                       weight_sync=dataclasses.replace(cfg.weight_sync, backend=backend))
    except ConfigError as e:
        raise ConfigError(f"with model.dtype={dtype} and weight_sync.backend={backend} (auto, for {gpus} GPU(s)): "
                          f"{e}") from None
    return resolved, notes


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config as `config.yaml` in the run directory."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(cfg))
    return out
