"""Training throughput of `Trainer.optimizer_step` against a bare PyTorch loop on the same model and tokens.

Measured: trained tokens (completion tokens in the loss) per second of wall time for one optimizer step on a
fixed batch of RL samples (groups of GROUP_SIZE sharing a ~16-token prompt, ~112-token completions, 0/1
rewards, behaviour log-probs near the random model's), built once:
- trainer: `Trainer(model, TrainerConfig(...)).optimizer_step(batch)` with recipes/tiny_cpu.yaml's algorithm
  (ppo_clip with clip-higher + grpo advantages; no KL, so no reference model; entropy_coef 0), everything
  it does per step included: validating and packing the samples, advantages, the chunked log-prob head,
  the loss and its stats, backward, clipping, AdamW, the scheduler;
- bare: a fresh copy of the same model (same weights, sdpa, fp32) and its own `torch.optim.AdamW` (the
  trainer's betas and weight decay), on the very micro-batches the trainer packs (`build_step`, done once,
  outside the timing), laid out as the trainer lays them out (`pipelinerl.rl.packing.packed_model_inputs`, once,
  outside the timing): right-padded rows where they cost less than one packed row under a block-diagonal causal
  mask (the headline model's ~128-token samples), else that row and mask.
  Per micro-batch: decoder forward -> LM head on every row -> log_softmax -> gather of the target tokens ->
  loss = sum of -advantage * log-prob over the completion tokens / samples -> backward; then
  clip_grad_norm_ (the trainer's grad_clip) -> step -> zero_grad. No framework.
Both sides run with THREADS torch thread(s) in this process, fp32, on the CPU (or the GPU where there is one;
the numbers in docs/benchmarks.md are CPU ones). The sides run interleaved (`bench.common.interleaved`:
one warm-up each, then rounds with one run of every side back to back), so a change in the machine's speed
hits them alike.

Target: `ratio` = trainer tokens/s / bare tokens/s >= 0.9 on the headline model (MODELS[0], ~24M parameters:
hidden 512, 4 layers, a 16k vocabulary so that the LM head is as large a share of the work as in a small
Qwen); the median over rounds of each round's bare seconds / trainer seconds. `ratio_cpu_time` is the same
with this process's CPU seconds (steadier when other processes load the machine). The tiny recipe's model
(hidden 128, 2 layers, 100-token vocabulary) is reported alongside; `--quick` runs only that one.

Where the difference goes:
- `variants`: the trainer with one feature switched on or changed through its config, in the same rounds:
  `kl_reference` (kl_coef 0.05: a frozen reference model's forward per micro-batch, KL in the loss),
  `entropy_bonus` (entropy_coef 0.01: the entropy carries a gradient), `logprob_chunk_256`
  (logprob_chunk_tokens 256 instead of 1024), `linear_kernel_auto` (the trainer's default: its linear layers
  through oneDNN where that was timed faster than torch's BLAS; the headline trainer and the bare loop both use
  torch's own matmuls, `linear_kernel: blas`, so that the ratio measures the framework); and
  `bare_chunked_head`, the bare loop with the trainer's
  log-prob gathering (`pipelinerl.trainer.forward.packed_logprobs`: chunked LM head whose backward recomputes the
  logits of every chunk but the first, the layout built per forward) in place of log_softmax + gather. Each
  gives seconds per step and its cost over the side it changes (median over rounds of the paired difference,
  in wall and in CPU seconds).
- `packing_s`: what validating and packing the batch and setting advantages cost per step, timed alone.
- `breakdown`: cProfile of one trainer step and one bare step, CPU seconds per step by stage (decoder forward,
  log-prob head forward / backward, the rest of the backward, loss and stats, clipping + AdamW, packing, ...),
  and `accelerate_python_s`, the time spent in accelerate's own Python frames. accelerate cannot be switched
  off through the config: on one CPU process `prepare` leaves the model as it is (no wrapper, no autocast)
  and wraps the optimizer in a pass-through `AcceleratedOptimizer`; `backward` and `clip_grad_norm_` are
  torch's behind one call. cProfile's own cost inflates the Python-heavy stages (packing: `packing_s` is its
  real cost).

What was found (numbers in docs/benchmarks.md): the one overhead that mattered was the chunked LM head's
backward recomputing the logits (one more [rows, vocab] matmul per chunk, ~6% of a step at the headline
model); it now starts from the forward's logits of the first chunk, so a micro-batch that fits in one chunk
recomputes nothing, and the trainer's head costs less than log_softmax over full logits. What remains is
small and needed: packing and validating the batch (a few ms), the layout (padded rows or mask) built per forward,
the loss's statistics, accelerate's pass-through calls (under 1 ms). The entropy computed for the stats at
entropy_coef 0 costs one more pass over each chunk's logits in the forward (within the noise). A KL reference
costs what it must: one more forward per micro-batch.

`shared_prompts`: the trainer with `trainer.share_prompts` (the default: a group's prompt through the model once,
where that costs less) and without, and the bare loop, on the tiny recipe's own batch shape (8 groups of 8 answers of
2-5 tokens to ~6-token prompts), interleaved. The headline batches (~112-token answers) do not share: a dense mask
over their answers costs more than the prompts saved, so there the trainer runs as before.

    python -m bench.trainer_vs_bare [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import math
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import format_table, interleaved, machine, median, model_settings, tiny_model, verdict

NAME = "trainer_vs_bare"
TARGET = 0.9
THREADS = 1  # recipes/tiny_cpu.yaml's trainer.threads
GROUP_SIZE = 8
PROMPT_TOKENS = (12, 20)  # inclusive ranges, drawn per group / per sample: ~16 + ~112 tokens
COMPLETION_TOKENS = (96, 128)
LR, GRAD_CLIP = 1e-3, 1.0
REPEATS, QUICK_REPEATS = 4, 3


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: str
    hidden_size: int
    num_layers: int
    vocab_size: int | None  # None: the char tokenizer's (build_tiny_model, as the tiny recipe has it)
    samples: int
    micro_batch_tokens: int
    repeats: int


MODELS = (
    # the headline: ~24M parameters, a third of them in the (tied) embedding / LM head; 16 samples (~2k tokens,
    # 2-3 micro-batches) keep a step near 5 s on one core
    ModelSpec("h512-l4-v16k", 512, 4, 16384, samples=16, micro_batch_tokens=1024, repeats=REPEATS),
    # the tiny recipe's model and batch (64 samples, micro_batch_tokens 2048)
    ModelSpec("h128-l2 (tiny recipe)", 128, 2, None, samples=64, micro_batch_tokens=2048, repeats=REPEATS + 1),
)
# trainer config changes timed alongside the default: one feature each
VARIANTS = {"kl_reference": {"kl_coef": 0.05}, "entropy_bonus": {"entropy_coef": 0.01},
            "logprob_chunk_256": {"logprob_chunk_tokens": 256}, "linear_kernel_auto": {"linear_kernel": "auto"}}


def run(quick: bool = False) -> dict:
    """Measure every model in MODELS (only the tiny one with `quick`); returns the JSON-able result."""
    torch.set_num_threads(THREADS)
    specs = [dataclasses.replace(MODELS[1], repeats=QUICK_REPEATS)] if quick else list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure_model(_build_model(Path(tmp), spec), spec) for spec in specs]
        shared = measure_shared_prompts(_build_model(Path(tmp), MODELS[1]), QUICK_REPEATS if quick else 2 * REPEATS)
    main = rows[0]
    return {
        "name": NAME,
        **verdict(main["ratio"], TARGET),
        "ratio_is": f"trainer / bare loop, trained tokens/s, model {main['model']} ({main['params']} params), "
                    "median of per-round ratios",
        "summary": "; ".join(f"{r['model']} ({r['params'] / 1e6:.1f}M): {r['ratio']:.3f} "
                             f"(CPU time {r['ratio_cpu_time']:.3f}, rounds {r['ratio_rounds']['min']:.2f}-"
                             f"{r['ratio_rounds']['max']:.2f})" for r in rows),
        "models": rows,
        "shared_prompts": shared,
        "settings": {"threads": THREADS, "dtype": "float32", "device": str(_device()), "group_size": GROUP_SIZE,
                     "prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "lr": LR,
                     "grad_clip": GRAD_CLIP, "algorithm": "ppo_clip + grpo (recipes/tiny_cpu.yaml)",
                     "attention": "sdpa; padded rows or a block-diagonal causal mask, as the trainer picks",
                     "variants": VARIANTS,
                     "statistic": "median of the per-round ratios of interleaved rounds (one warm-up run each)"},
        "machine": machine(),
    }


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _build_model(root: Path, spec: ModelSpec) -> Path:
    """A random Qwen2 model saved under `root`, nothing downloaded: the tiny recipe's (char tokenizer) or one
    with a larger vocabulary straight from a Qwen2Config (the trainer needs no tokenizer)."""
    if spec.vocab_size is None:
        return tiny_model(root, spec.hidden_size, spec.num_layers)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / f"qwen2-h{spec.hidden_size}-l{spec.num_layers}-v{spec.vocab_size}"
    config = Qwen2Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.hidden_size // 64, num_key_value_heads=2,
                         intermediate_size=4 * spec.hidden_size, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(num_samples: int, vocab_size: int, seed: int = 0, prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
               completion_tokens: tuple[int, int] = COMPLETION_TOKENS) -> list:
    """Groups of GROUP_SIZE samples sharing a prompt, with mixed 0/1 rewards (so GRPO's advantages are not all
    0) and behaviour log-probs around a random model's (-log vocab), so PPO's ratios stay near 1."""
    from pipelinerl.samples import Sample

    rng = random.Random(seed)
    samples = []
    for g in range(math.ceil(num_samples / GROUP_SIZE)):
        prompt = [rng.randrange(4, vocab_size) for _ in range(rng.randint(*prompt_tokens))]
        for j in range(min(GROUP_SIZE, num_samples - len(samples))):
            n = rng.randint(*completion_tokens)
            samples.append(Sample(
                group_id=f"g{g}", prompt_token_ids=prompt,
                output_token_ids=[rng.randrange(4, vocab_size) for _ in range(n)],
                behav_logprobs=[min(0.0, -math.log(vocab_size) + rng.gauss(0, 0.3)) for _ in range(n)],
                versions=[0] * n, finish_reason="stop", reward=float(j % 2 if j < 2 else rng.random() < 0.5)))
    return samples


def trainer_config(spec: ModelSpec, **changes):
    from pipelinerl.config import TrainerConfig

    # torch's own matmuls, as the bare loop's nn.Linear: the ratio measures the framework, not the kernel choice
    # (the `linear_kernel_auto` variant is the trainer as a recipe runs it, oneDNN where timed faster)
    changes = {"linear_kernel": "blas", **changes}
    return TrainerConfig(lr=LR, grad_clip=GRAD_CLIP, policy_loss="ppo_clip", advantage="grpo",
                         samples_per_step=spec.samples, micro_batch_tokens=spec.micro_batch_tokens, threads=THREADS,
                         **changes)


class TrainerStep:
    """Calling it runs one `optimizer_step` on the batch; keeps the last stats."""

    def __init__(self, path: Path, spec: ModelSpec, batch: list, **changes):
        from pipelinerl.trainer import Trainer

        self.trainer = Trainer(str(path), trainer_config(spec, **changes), seed=0)
        self.batch = batch
        self.stats: dict[str, float] = {}

    def __call__(self) -> None:
        self.stats = self.trainer.optimizer_step(self.batch)
        if self.stats["skipped"]:
            raise RuntimeError(f"the trainer skipped its update: {self.stats}")


@dataclasses.dataclass
class _BareMicroBatch:
    inputs: dict  # the decoder's keyword arguments: padded rows [N, L], or the packed row [1, T] and its mask
    before: torch.Tensor  # [T - 1]: the flattened output row that predicts each target
    targets: torch.Tensor  # [T - 1]: token t + 1, predicted from row t
    weights: torch.Tensor  # [T - 1]: advantage / samples on completion tokens, 0 elsewhere
    packed: object  # the trainer's PackedBatch, for the chunked-head variant
    packed_weights: torch.Tensor  # [T], aligned with input_ids


class BareLoop:
    """Forward, log-softmax gather, the simplest policy-gradient loss, backward per micro-batch; clip, AdamW.

    `chunked_head`: the log-probs come from the trainer's `packed_logprobs` (chunked LM head, layout built per
    forward) instead, everything else alike: what the trainer's log-prob gathering costs on its own."""

    def __init__(self, path: Path, spec: ModelSpec, batch: list, chunked_head: bool = False):
        from transformers import AutoModelForCausalLM

        from pipelinerl.rl.packing import packed_model_inputs
        from pipelinerl.trainer.batch import build_step, sample_advantages, set_sample_advantages

        device = _device()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model.config.use_cache = False
        self.model.to(device).train()
        cfg = trainer_config(spec)
        # fused on CPU, as the trainer's (build_optimizer): the baseline gets torch's fastest AdamW too
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay, fused=device.type == "cpu" or None)
        self.chunked_head = chunked_head
        self.chunk_tokens = cfg.logprob_chunk_tokens
        # the trainer's own packing and GRPO advantages, once, outside the timing
        step = build_step(batch, spec.micro_batch_tokens, device=device)
        step.advantages = sample_advantages(step, cfg.with_algorithm_defaults())
        set_sample_advantages(step.micro_batches, step.advantages)
        self.micro_batches = []
        for mb in step.micro_batches:
            p = mb.packed
            weights = torch.where(p.fields["loss_mask"], p.fields["advantages"], 0.0) / step.num_samples
            inputs, index = packed_model_inputs(p, "sdpa", "auto", self.model.config)
            before = torch.arange(p.input_ids.shape[1] - 1) if index is None else index[1:] - 1
            self.micro_batches.append(_BareMicroBatch(inputs, before, p.input_ids[0, 1:], weights[1:], p, weights))
        self.tokens = int(sum(int(mb.packed.fields["loss_mask"].sum()) for mb in step.micro_batches))

    def __call__(self) -> None:
        for mb in self.micro_batches:
            loss = self._loss(mb)
            loss.backward()
        self._update()

    def _loss(self, mb: _BareMicroBatch) -> torch.Tensor:
        if self.chunked_head:
            from pipelinerl.trainer.forward import packed_logprobs

            logprobs = packed_logprobs(self.model, mb.packed, 1.0, "auto", self.chunk_tokens)
            return -(mb.packed_weights * logprobs).sum()
        hidden = self._decoder_forward(mb)
        return -(mb.weights * self._head_logprobs(hidden, mb.targets)).sum()

    def _decoder_forward(self, mb: _BareMicroBatch) -> torch.Tensor:
        hidden = self.model.model(**mb.inputs).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[mb.before]

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden).float()
        return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)

    def _update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def measure_model(path: Path, spec: ModelSpec) -> dict:
    """Interleaved timings of the trainer, the bare loop and the variants on one model, then the breakdown."""
    config = json.loads((path / "config.json").read_text())
    batch = make_batch(spec.samples, config["vocab_size"])
    trainer = TrainerStep(path, spec, batch)
    bare = BareLoop(path, spec, batch)
    runs: dict[str, Callable[[], None]] = {"trainer": trainer, "bare": bare,
                                           "bare_chunked_head": BareLoop(path, spec, batch, chunked_head=True)}
    runs.update({name: TrainerStep(path, spec, batch, **changes) for name, changes in VARIANTS.items()})
    wall, cpu = interleaved(runs, spec.repeats)
    tokens = int(trainer.stats["tokens"])
    if tokens != bare.tokens:  # the two sides must train on the same tokens for the ratio to mean anything
        raise RuntimeError(f"the trainer trained on {tokens} tokens, the bare loop on {bare.tokens}")

    def rounds(times: dict[str, list[float]], num: str, den: str) -> list[float]:
        return sorted(a / b for a, b in zip(times[num], times[den]))

    per_round = rounds(wall, "bare", "trainer")
    med = {name: median(ts) for name, ts in wall.items()}
    variants = {}
    for name in ("bare_chunked_head", *VARIANTS):
        base = "bare" if name.startswith("bare") else "trainer"
        variants[name] = {"seconds_per_step": round(med[name], 4), "cpu_seconds_per_step": round(median(cpu[name]), 4),
                          "compared_with": base,
                          "cost_s": round(median([v - b for v, b in zip(wall[name], wall[base])]), 4),
                          "cost_cpu_s": round(median([v - b for v, b in zip(cpu[name], cpu[base])]), 4)}
    breakdown = {"trainer": profile_trainer(trainer), "bare": profile_bare(bare)}
    packing_s = time_packing(trainer)
    params = sum(p.numel() for p in bare.model.parameters())
    row = {"model": spec.label, "params": params, **model_settings(path), "samples": spec.samples,
           "micro_batch_tokens": spec.micro_batch_tokens, "micro_batches": int(trainer.stats["micro_batches"]),
           "trained_tokens_per_step": tokens,
           "forward_tokens_per_step": sum(mb.packed.input_ids.shape[1] for mb in bare.micro_batches),
           "padded_layout_micro_batches": sum(mb.inputs["input_ids"].shape[0] > 1 for mb in bare.micro_batches),
           "trainer_tokens_per_s": round(tokens / med["trainer"], 1),
           "bare_tokens_per_s": round(tokens / med["bare"], 1),
           "ratio": round(median(per_round), 3),
           "ratio_rounds": {"min": round(per_round[0], 3), "median": round(median(per_round), 3),
                            "max": round(per_round[-1], 3)},
           "ratio_cpu_time": round(median(rounds(cpu, "bare", "trainer")), 3),
           "ratio_of_medians": round(med["bare"] / med["trainer"], 3),
           "seconds_per_step": {name: round(s, 4) for name, s in med.items()},
           "variants": variants, "packing_s": round(packing_s, 5), "breakdown": breakdown,
           "wall_seconds": {name: [round(t, 4) for t in ts] for name, ts in wall.items()},
           "cpu_seconds": {name: [round(t, 4) for t in ts] for name, ts in cpu.items()}}
    del runs, trainer, bare
    gc.collect()
    return row


# the tiny recipe's own batches (recipes/tiny_cpu.yaml: 8 groups of 8 answers of 2-5 tokens, each "12+34=" style
# prompt ~6 tokens), where a group's prompt is most of its tokens
TINY_RECIPE_BATCH = {"prompt_tokens": (5, 7), "completion_tokens": (2, 5)}


def measure_shared_prompts(path: Path, repeats: int) -> dict:
    """`trainer.share_prompts` on the tiny recipe's own batch shape: the trainer with it (the default) and without,
    and the bare loop (which packs every sequence whole), interleaved: seconds per step and the tokens each puts
    through the model."""
    spec = MODELS[1]
    config = json.loads((path / "config.json").read_text())
    batch = make_batch(spec.samples, config["vocab_size"], **TINY_RECIPE_BATCH)
    shared, whole = TrainerStep(path, spec, batch), TrainerStep(path, spec, batch, share_prompts=False)
    bare = BareLoop(path, spec, batch)
    wall, cpu = interleaved({"shared": shared, "whole": whole, "bare": bare}, repeats)
    med = {name: median(ts) for name, ts in wall.items()}
    return {"model": spec.label, "samples": spec.samples, "batch": TINY_RECIPE_BATCH,
            "model_tokens_per_step": {"shared": int(shared.stats["model_tokens"]),
                                      "whole": int(whole.stats["model_tokens"])},
            "trained_tokens_per_step": int(shared.stats["tokens"]),
            "seconds_per_step": {name: round(s, 4) for name, s in med.items()},
            "speedup_over_whole": round(median([w / s for w, s in zip(wall["whole"], wall["shared"])]), 3),
            "trainer_over_bare": round(median([b / s for b, s in zip(wall["bare"], wall["shared"])]), 3),
            "cpu_seconds_per_step": {name: round(median(ts), 4) for name, ts in cpu.items()}}


def time_packing(trainer: TrainerStep, repeats: int = 5) -> float:
    """Seconds to validate and pack the batch and put the advantages on its tokens, as `optimizer_step` does."""
    from pipelinerl.trainer.batch import build_step, sample_advantages, set_sample_advantages

    t, cfg = trainer.trainer, trainer.trainer.cfg
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = build_step(trainer.batch, cfg.micro_batch_tokens, 0, 1, t.accelerator.device, cfg.ppo_minibatches,
                          cfg.overlong_filtering)
        step.advantages = sample_advantages(step, cfg)
        set_sample_advantages(step.micro_batches, step.advantages)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profile(fn: Callable[[], None]) -> tuple[pstats.Stats, float]:
    """cProfile of one call, timed in this process's CPU seconds: other processes' load does not show in it."""
    profiler = cProfile.Profile(time.process_time)
    t0 = time.process_time()
    profiler.runcall(fn)
    return pstats.Stats(profiler), time.process_time() - t0


def _cumulative(stats: pstats.Stats, path_end: str, function: str) -> float:
    """Cumulative seconds of the functions named `function` in files whose path ends with `path_end`."""
    return sum(ct for (file, _, name), (_, _, _, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
               if name == function and file.replace("\\", "/").endswith(path_end))


def _own_time(stats: pstats.Stats, path_part: str) -> float:
    """Seconds spent in the frames of the files whose path contains `path_part` themselves (not their callees)."""
    return sum(tt for (file, _, _), (_, _, tt, _, _) in stats.stats.items()  # type: ignore[attr-defined]
               if path_part in file.replace("\\", "/"))


def _rounded(parts: dict[str, float], total: float) -> dict[str, float]:
    out = {name: round(max(s, 0.0), 4) for name, s in parts.items()}
    out["other"] = round(total - sum(parts.values()), 4)
    out["total"] = round(total, 4)
    return out


def profile_trainer(step: TrainerStep) -> dict[str, float]:
    """One profiled `optimizer_step` of the default config (no reference or proximal pass), seconds by stage."""
    stats, total = _profile(step)
    head_fwd = _cumulative(stats, "pipelinerl/trainer/forward.py", "forward")  # ChunkedHeadLogprobs
    head_bwd = _cumulative(stats, "pipelinerl/trainer/forward.py", "backward")
    mask = _cumulative(stats, "pipelinerl/rl/packing.py", "packed_model_inputs")
    logprobs = _cumulative(stats, "pipelinerl/trainer/forward.py", "packed_logprobs_and_entropy")
    parts = {
        "packing_and_advantages": _cumulative(stats, "pipelinerl/trainer/batch.py", "build_step")
        + _cumulative(stats, "pipelinerl/trainer/trainer.py", "_set_advantages"),
        "attention_mask": mask,
        "decoder_forward": logprobs - head_fwd - mask,
        "logprob_head_forward": head_fwd,
        "loss_and_stats": _cumulative(stats, "pipelinerl/trainer/trainer.py", "_micro_batch_loss") - logprobs,
        "backward_decoder": _cumulative(stats, "pipelinerl/trainer/trainer.py", "_backward") - head_bwd,
        "logprob_head_backward": head_bwd,
        "clip_and_adamw": _cumulative(stats, "pipelinerl/trainer/trainer.py", "_apply_update"),
    }
    out = _rounded(parts, total)
    out["accelerate_python_s"] = round(_own_time(stats, "/accelerate/"), 5)
    return out


def profile_bare(bare: BareLoop) -> dict[str, float]:
    """One profiled bare step, seconds by stage (the head's backward runs inside torch's, not separable here)."""
    stats, total = _profile(bare)
    parts = {
        "decoder_forward": _cumulative(stats, "bench/trainer_vs_bare.py", "_decoder_forward"),
        "logprob_head_forward": _cumulative(stats, "bench/trainer_vs_bare.py", "_head_logprobs"),
        "backward": _cumulative(stats, "torch/_tensor.py", "backward"),
        "clip_and_adamw": _cumulative(stats, "bench/trainer_vs_bare.py", "_update"),
    }
    return _rounded(parts, total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer_vs_bare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model only, fewer rounds (~1 minute)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    m = result["machine"]
    print(f"cpu: {m['cpu']}, {m['cores']} cores, load {m['load_average_1m']}; threads {THREADS}")
    for r in result["models"]:
        print(f"\n{r['model']}: {r['params'] / 1e6:.1f}M params, {r['samples']} samples, "
              f"{r['trained_tokens_per_step']} trained tokens in {r['micro_batches']} micro-batches")
        rows = []
        for name, s in r["seconds_per_step"].items():
            v = r["variants"].get(name)
            rows.append([name, f"{s:.3f}", f"{median(r['cpu_seconds'][name]):.3f}",
                         f"{r['trained_tokens_per_step'] / s:.0f}",
                         f"{v['cost_s']:+.3f} / {v['cost_cpu_s']:+.3f} vs {v['compared_with']}" if v else ""])
        print(format_table(rows, ["side", "s/step", "CPU s/step", "tokens/s", "cost s (wall / CPU)"]))
        tb, bb = r["breakdown"]["trainer"], r["breakdown"]["bare"]
        stages = list(dict.fromkeys([*tb, *bb]))
        print()
        print(format_table([[k, f"{tb[k]:.4f}" if k in tb else "", f"{bb[k]:.4f}" if k in bb else ""]
                            for k in stages], ["stage (profiled, CPU s)", "trainer", "bare"]))
        print(f"ratio {r['ratio']:.3f} (CPU time {r['ratio_cpu_time']:.3f}); packing alone {r['packing_s']:.4f} s")
    sp = result["shared_prompts"]
    print(f"\ntrainer.share_prompts on the tiny recipe's batch shape ({sp['samples']} samples, {sp['batch']}): "
          f"{sp['speedup_over_whole']:.2f}x over whole sequences, {sp['trainer_over_bare']:.2f}x the bare loop")
    print(format_table([[name, f"{s:.4f}", f"{sp['cpu_seconds_per_step'][name]:.4f}",
                         str(sp["model_tokens_per_step"].get(name, sp["model_tokens_per_step"]["whole"]))]
                        for name, s in sp["seconds_per_step"].items()],
                       ["side", "s/step", "CPU s/step", "tokens through the model"]))
    print(f"\nratio {result['ratio']:.3g} (target {result['target']:g}, passed: {result['passed']}): "
          f"{result['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
