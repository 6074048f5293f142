"""pipelinerl against TRL's GRPOTrainer: wall-clock time to the same held-out accuracy (`make compare-trl`, i.e.
`python -m bench.vs_trl [--recipe R] [--lrs-pipelinerl a,b,c] [--lrs-trl a,b,c] [--steps N] [--quick]`; needs the
`bench` extra, TRL).

Both sides run one recipe's workload on the same cores: the same task, train and held-out problems, the same
warmed-up base model (built once by pipelinerl's launcher code and cached in runs/bench/<recipe>/base_model), the
same samples per optimizer step and group size, the same number of optimizer steps per run and the same held-out
evaluation (pass@1 averaged over trainer.eval_k samples per problem, sampled at temperature 1, scored by the task's
verifier, every --eval-every steps). Each side runs a learning-rate grid (by default the recipe's lr x 1/10, 1/3,
1, 3 for both); the comparison takes each side's best. A run that diverges (held-out accuracy below half the
start's at 3 evaluations in a row) or takes 3x longer than the longest run before it is stopped; its evaluations so
far count.

- pipelinerl: `pipelinerl run RECIPE` as a subprocess, the recipe as written but for the overrides above.
- TRL: `trl.GRPOTrainer` in a subprocess (`--trl-worker`), configured by `trl_config` to match the recipe where TRL
  has the knob (see there); generation by the policy itself (transformers' `generate`, TRL's default without vLLM);
  torch threads: 1 or the cores pipelinerl's engine and trainer compute with, whichever a short timed run of each
  finds faster (`probe_trl_threads`), unless --trl-threads says.

Evaluation. Both sides' held-out evaluations are made by one function (`hf_evaluate`: transformers' sampling, the
task's verifier, the seed recipe seed + step), so they differ only in the model evaluated. TRL evaluates in its
process between steps. pipelinerl's run evaluates nothing itself: its trainer writes a Hugging Face export every
--eval-every steps and after the last (`trainer.export_every`; the export's time stays on its clock), and the exports
are evaluated after the run (`evaluate_exports`, step 0 being the base model). Evaluating inside pipelinerl's run
would favour it: its actor keeps generating while its trainer evaluates (docs/benchmarks.md: runs of a seed with
and without evaluations reached the target up to 22% sooner, or 10% later, with them).

Clocks. Both start when the command is started (`launch_s`: imports, model loading and pipelinerl's engine start-up
included; the shared base-model build is not) and both leave out the time of held-out evaluations, which only
measure. The other clock (`train_s`) starts when training starts (pipelinerl: the trainer's clock, engines up;
TRL: on_train_begin). Where a pipelinerl run evaluated in its own run (results from before exports), its actor
generated during evaluations, at most max_lag + 1 batches ahead; `pipelinerl_eval_overlap_bound_s` adds that up to
the target and `ratio_worst_case` charges it all (with exports, both are 0 and the ratio itself).

Result: target accuracy = base + --target-fraction (default 0.9) of the way from the base model's held-out accuracy
(the mean of every run's step-0 evaluation) to the lower of the two sides' best final accuracies; for each run the
time to reach it, interpolated linearly between the evaluations around the first crossing; ratio = TRL's best time
/ pipelinerl's best time. Targets: 1x on a small workload, 2x on a heavy one (a model of at least 20M parameters and
at least 128 new tokens per answer). Writes bench/results/vs_trl_<recipe>.json and .png (held-out accuracy
against wall-clock seconds and against steps, every run of the grid, each side's best drawn bold); runs of another
length than the recipe's (--steps, --quick) or with --set overrides are written under their own names.

Seeds (--seeds 0,1,2,...). One run's time to a target is placed by the evaluation that first crosses it, and near
the top of a learning curve that is as much sampling noise and the run's own luck as speed: the same comparison
gave 1.2x to 4.7x from seed to seed on the heavier workload. With --seeds the comparison runs once per seed
(`--seed` each, so each seed's files stay its own and --reuse reads back the seeds already run), then judges the
seeds' mean curves (`pool_seeds`: each side's held-out accuracy and clock averaged over the seeds at each step they
all evaluated) by the same `analyse`. That ratio is held against the target; beside it, each seed's own ratio and
the 5th-95th percentiles of the pooled ratio over seeds resampled with replacement (`seed_bootstrap`). Writes
vs_trl_<workload>-seeds<a>_<b>_....json and .png (the mean curves bold, each seed's thin)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, cached_base_model, machine, median, subprocess_env

NAME = "vs_trl"
ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
HEAVY_RECIPE = ROOT / "recipes" / "counting_cpu.yaml"  # the heavier workload (a ~20M model, >=128-token answers)
WORK_DIR = ROOT / "runs" / "vs_trl"
SIDES = ("pipelinerl", "trl")
HEAVY_PARAMS, HEAVY_TOKENS = 20_000_000, 128  # the heavier workload, which has the 2x target
# around the recipe's lr, more below it than above: a recipe whose loss sums each sample's tokens (ppo_clip's default
# aggregation) has larger gradients than TRL's mean over tokens, which hit the clip sooner, so the sides' best lrs
# can differ
LR_GRID_FACTORS = (0.1, 1 / 3, 1.0, 3.0)
TRL_MISSING = "trl is not installed (pip install -e '.[bench]')"


# --- pure parts: clocks, time to accuracy, the verdict --------------------------------------------------------------

def time_to_accuracy(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The time at which a held-out curve of (time, accuracy) points, in time order, first reaches `target`:
    linearly interpolated between the last evaluation below it and the first at or above it (the first point's
    time if that one is already there); None if it never does."""
    previous: tuple[float, float] | None = None
    for t, acc in points:
        if acc >= target - 1e-12:
            if previous is None or acc == previous[1]:
                return t
            t0, a0 = previous
            return t0 + (target - a0) / (acc - a0) * (t - t0)
        previous = (t, acc)
    return None


def diverged(accuracies: Sequence[float], patience: int = 3) -> bool:
    """A run has diverged when its last `patience` held-out evaluations after the first are all below half the
    first one's accuracy: it is below where it started, so it cannot be on its way to a target above the base, and
    with dynamic sampling a collapsed policy makes every group all-wrong, so each step costs ever more generation
    (a pipelinerl run at lr 3e-3 on the tiny recipe fell to 0.006 and to 17 s a step). Such a run is stopped; its
    evaluations so far still count."""
    later = list(accuracies[1:])
    return len(later) >= patience and all(a < 0.5 * accuracies[0] for a in later[-patience:])


def first_eval_at(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The time of the first evaluation at or above `target` (no interpolation), None if none is."""
    return next((t for t, acc in points if acc >= target - 1e-12), None)


def pipelinerl_curves(rows: list[dict], seen_wall: list[float] | None = None,
                      launch_wall: float | None = None) -> dict:
    """A pipelinerl run's metrics rows (in file order) on the benchmark's clocks. `train_s`: the trainer's own clock
    (`time`, from when it had loaded the model and reached the engines) less the held-out evaluations before the row.
    `launch_s`, when `seen_wall` (the wall time each row was first seen in the file) and `launch_wall` (when the
    command started) are given: the same, counted from the command's start; the trainer's start in wall time is
    estimated as min(seen - time) over the rows, the row seen soonest after it was written."""
    offset = None
    if seen_wall is not None and launch_wall is not None and rows:
        offset = min(seen - r["time"] for seen, r in zip(seen_wall, rows)) - launch_wall
    evals, steps, eval_total = [], [], 0.0
    start = {"train_s": 0.0, **({"launch_s": offset} if offset is not None else {})}  # where step 0's model is
    for r in rows:
        train_s = r["time"] - eval_total
        clocks = {"train_s": train_s, **({"launch_s": offset + train_s} if offset is not None else {})}
        if "eval_accuracy" in r:
            evals.append({"step": r["step"], "accuracy": r["eval_accuracy"], **clocks})
            eval_total += r.get("eval_seconds", 0.0)
        elif "samples_per_s" in r:
            steps.append({"step": r["step"], "samples": r.get("samples", 0), **clocks})
    return {"evals": evals, "steps": steps, "eval_seconds_total": eval_total, "start": start}


def seconds_per_step(steps: list[dict], skip_frac: float = 0.1) -> float | None:
    """Mean seconds per optimizer step on the train clock, after the first `skip_frac` of the steps (start-up)."""
    if len(steps) < 2:
        return None
    skip = min(len(steps) - 2, int(len(steps) * skip_frac))
    first, last = steps[skip], steps[-1]
    return (last["train_s"] - first["train_s"]) / max(1, last["step"] - first["step"])


def analyse(runs: list[dict], target_fraction: float = 0.9, clock: str = "launch_s") -> dict:
    """The comparison of a workload's grid. Each run: {"side", "lr", "evals": [{"step", "accuracy", <clock>...}]}.
    Returns the target accuracy, every run's time to it, each side's best run and the ratio TRL / pipelinerl."""
    base_points = [r["evals"][0]["accuracy"] for r in runs if r["evals"] and r["evals"][0]["step"] == 0]
    base = sum(base_points) / len(base_points) if base_points else 0.0
    best_final = {side: max((r["evals"][-1]["accuracy"] for r in runs if r["side"] == side and r["evals"]),
                            default=None) for side in SIDES}
    out: dict[str, Any] = {"base_accuracy": base, "best_final_accuracy": best_final, "clock": clock,
                           "target_fraction": target_fraction}
    if any(v is None for v in best_final.values()):
        return {**out, "target_accuracy": None, "ratio": None, "why": "a side has no finished run"}
    ceiling = min(best_final.values())
    if ceiling <= base:
        return {**out, "target_accuracy": None, "ratio": None,
                "why": f"no learning to compare: the lower best final accuracy {ceiling:.3f} is not above the base "
                       f"{base:.3f}"}
    target = base + target_fraction * (ceiling - base)
    per_run, best = [], {}
    for r in runs:
        points = [(e[clock], e["accuracy"]) for e in r["evals"]]
        t = time_to_accuracy(points, target)
        per_run.append({"side": r["side"], "lr": r["lr"], "seconds_to_target": t,
                        "first_eval_at_target_s": first_eval_at(points, target),
                        "steps_to_target": first_eval_at([(e["step"], e["accuracy"]) for e in r["evals"]], target)})
        if t is not None and (r["side"] not in best or t < best[r["side"]]["seconds_to_target"]):
            best[r["side"]] = per_run[-1]
    ratio = None
    if "pipelinerl" in best and "trl" in best and best["pipelinerl"]["seconds_to_target"] > 0:
        ratio = best["trl"]["seconds_to_target"] / best["pipelinerl"]["seconds_to_target"]
    return {**out, "target_accuracy": target, "per_run": per_run, "best": best, "ratio": ratio}


def grid_runs(result: dict) -> list[dict]:
    """A saved result's grid (rows of [step, accuracy, launch_s, train_s]) as runs for `analyse`."""
    return [{"side": r["side"], "lr": r["lr"],
             "evals": [{"step": s, "accuracy": a, "launch_s": t, "train_s": u} for s, a, t, u in r["held_out"]]}
            for r in result["grid"]]


def pool_seeds(grids: Sequence[Sequence[dict]]) -> list[dict]:
    """Several seeds' grids of runs as one grid of mean curves: for each (side, lr) that every seed ran, the held-out
    accuracy averaged over the seeds at each step that every seed's run evaluated, at the mean of their clocks there.

    One seed's time to a target is decided by the evaluation that first crosses it, and each evaluation carries
    sampling noise (about 0.02 on 400 answers) as well as the run's own luck; the mean curve of n seeds carries
    1/sqrt(n) of it, so `analyse` of the pooled grid estimates the expected time to the expected accuracy."""
    if not grids:
        return []
    keys = [(r["side"], r["lr"]) for r in grids[0]]
    pooled = []
    for side, lr in keys:
        runs = [next((r for r in grid if (r["side"], r["lr"]) == (side, lr)), None) for grid in grids]
        if any(r is None or not r["evals"] for r in runs):
            continue
        by_step = [{e["step"]: e for e in r["evals"]} for r in runs]
        steps = sorted(set.intersection(*(set(b) for b in by_step)))
        evals = [{"step": step, **{k: sum(b[step][k] for b in by_step) / len(by_step)
                                   for k in ("accuracy", "launch_s", "train_s")}} for step in steps]
        pooled.append({"side": side, "lr": lr, "evals": evals})
    return pooled


def seed_bootstrap(grids: Sequence[Sequence[dict]], target_fraction: float = 0.9, draws: int = 2000,
                   rng_seed: int = 0) -> dict:
    """How much the pooled ratio depends on which seeds ran: `analyse(pool_seeds(...))` over `draws` resamples of
    the seeds with replacement (a seed's two sides stay together). Returns the 5th, 50th and 95th percentiles of
    the ratio and how many resamples had none (a side never reached the target)."""
    import random

    rng = random.Random(rng_seed)
    ratios: list[float] = []
    for _ in range(draws):
        pick = [grids[rng.randrange(len(grids))] for _ in grids]
        ratio = analyse(pool_seeds(pick), target_fraction)["ratio"]
        if ratio is not None:
            ratios.append(ratio)
    ratios.sort()

    def percentile(q: float) -> float | None:
        return ratios[min(len(ratios) - 1, int(q * len(ratios)))] if ratios else None

    return {"draws": draws, "without_ratio": draws - len(ratios), "p05": percentile(0.05), "p50": percentile(0.5),
            "p95": percentile(0.95)}


def is_heavy(params: int, max_new_tokens: int) -> bool:
    """The issue's heavier workload: a model of at least 20M parameters writing at least 128 new tokens."""
    return params >= HEAVY_PARAMS and max_new_tokens >= HEAVY_TOKENS


def lr_grid(recipe_lr: float) -> list[float]:
    return [float(f"{recipe_lr * f:.3g}") for f in LR_GRID_FACTORS]


# --- the shared setup -----------------------------------------------------------------------------------------------

def common_overrides(base_model: Path, lr: float, steps: int, eval_every: int) -> list[str]:
    """The recipe overrides both sides run with: the shared base model, the grid's lr, the step budget, evaluation
    every `eval_every` steps sampled at temperature 1 (whatever the recipe's eval says), no periodic checkpoints."""
    return [f"model.path={base_model}", f"trainer.lr={lr}", f"trainer.max_steps={steps}",
            f"trainer.eval_every={eval_every}", "eval.temperature=1.0", "trainer.eval_greedy=false",
            "trainer.save_every=0", "trainer.save_every_minutes=0"]


def run_cost_s(run: dict) -> float:
    """The wall time a finished run took, its held-out evaluations included: TRL evaluates inside its run,
    pipelinerl (`evaluated: exports`) after it. The default budget of the next run is a multiple of the longest, so
    a TRL run that evaluates often is not stopped for the time pipelinerl spent evaluating outside its run."""
    after = (run.get("eval_seconds_total") or 0.0) if run.get("evaluated") == "exports" else 0.0
    return run["wall_s"] + after


def prepare_base_model(recipe: Path, path: Path, extra: Sequence[str] = ()) -> Path:
    """The recipe's base model: the model it names, or (`model.init: tiny`) a tiny model and its supervised warm-up,
    built once by the launcher's own code and cached in `path` (its marker file says with which settings; a changed
    recipe rebuilds)."""
    from pipelinerl.config import load_config
    from pipelinerl.launch import prepare_model

    cfg = load_config(recipe, [*extra, f"run_dir={path.parent}"])
    if cfg.model.init != "tiny":
        return Path(cfg.model.path)
    return prepare_model(load_config(recipe, [*extra, f"run_dir={path.parent}", f"model.path={path}"]))


def model_size(path: Path) -> int:
    """Parameters of a saved model, from its safetensors headers (nothing loaded)."""
    import struct

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def trainer_cores(cfg) -> int:
    """The cores a pipelinerl run of `cfg` computes on: its engines' and its trainer processes' threads, but no more
    than the machine has (a recipe may give its trainer a core it shares with the engine, as counting_cpu does)."""
    threads = cfg.engine.threads * max(1, cfg.engine.num_engines) + cfg.trainer.threads * cfg.trainer.num_processes
    return max(1, min(threads, os.cpu_count() or threads))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- pipelinerl side ------------------------------------------------------------------------------------------------

STALL_MARK = "dynamic sampling dropped"  # how pipelinerl's actor says it stopped a run (pipelinerl/actor.py)


def stall_reason(log_text: str) -> str | None:
    """Why a pipelinerl run that exited non-zero stopped, where its actor stopped it because dynamic sampling
    dropped `actor.max_dropped_in_a_row` all-wrong groups in a row (a policy that gets nothing right any more, as a
    run late in training at a high lr can): "stalled: dynamic sampling dropped N groups in a row". Such a run is
    reported as stopped, its evaluations so far counting, as a diverged one is; any other failure is None (an
    error)."""
    for line in reversed(log_text.splitlines()):
        at = line.find(STALL_MARK)
        if at >= 0:
            return "stalled: " + line[at:].split(" (", 1)[0].removesuffix(" whose answers were all wrong")
    return None


def run_pipelinerl(recipe: Path, run_dir: Path, overrides: list[str], budget_s: float) -> dict:
    """`pipelinerl run` as a user runs it; its metrics.jsonl is followed while it runs so that every row gets the
    wall time it appeared at (the launch clock). A run that diverges (`diverged`) or outlives `budget_s` is stopped
    as a user would stop it (SIGTERM: the launcher stops every process of the run) and reported with `stopped`, as
    is one its actor stopped for dynamic sampling's stall (`stall_reason`); any other failure raises."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun in the same directory would resume, not start over
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(recipe), f"run_dir={run_dir}", *overrides]
    metrics = run_dir / "metrics.jsonl"
    rows, seen, offset, stopped = [], [], 0, None
    launch_wall = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT)
        try:
            while True:
                done = proc.poll() is not None
                if metrics.exists():
                    with open(metrics, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    complete = chunk[: chunk.rfind(b"\n") + 1]
                    offset += len(complete)
                    now = time.time()
                    for line in complete.decode().splitlines():
                        rows.append(json.loads(line))
                        seen.append(now)
                if done:
                    break
                if diverged([r["eval_accuracy"] for r in rows if "eval_accuracy" in r]):
                    stopped = "diverged"
                elif time.time() - launch_wall > budget_s:
                    stopped = f"over its budget of {budget_s:.0f} s"
                if stopped:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(300)
                    break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
    wall = time.time() - launch_wall
    if proc.returncode != 0 and not stopped:
        stopped = stall_reason(log.read_text(errors="replace"))
        if not stopped:
            raise RuntimeError(f"pipelinerl run in {run_dir} failed (exit {proc.returncode}); log {log}:\n"
                               f"{_tail(log)}")
    curves = pipelinerl_curves(rows, seen, launch_wall)
    actor = [json.loads(line) for line in (run_dir / "actor_metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "actor_metrics.jsonl").exists() else []
    last = actor[-1] if actor else {}
    started = last.get("groups_started", 0)
    dropped = last.get("groups_dropped_all_correct", 0) + last.get("groups_dropped_all_wrong", 0)
    steps = [r for r in rows if "samples_per_s" in r]
    return {**curves, "wall_s": wall, "log": str(log), "stopped": stopped,
            "groups_dropped_frac": dropped / started if started else None,
            "output_tokens_mean": (sum(r.get("output_tokens_mean", 0) for r in steps) / len(steps)) if steps else None}


# --- TRL side -------------------------------------------------------------------------------------------------------

def trl_config(cfg, lr: float, steps: int, output_dir: Path) -> Any:
    """TRL's GRPOConfig for a pipelinerl recipe, matched where TRL has the knob:
    - one optimizer step = trainer.samples_per_step samples = samples_per_step / group_size prompts x group_size
      (per_device_train_batch_size = generation_batch_size = samples_per_step, gradient_accumulation_steps =
      steps_per_generation = num_iterations = 1: each step trains once on a batch generated by the current policy);
    - num_generations = sampling.group_size, max_completion_length = sampling.max_new_tokens, temperature / top_p /
      top_k = sampling's (1.0 / 1.0 / 0: plain sampling);
    - beta 0 (no KL, no reference model) unless trainer.kl_coef says otherwise; the clip range of the recipe's
      ppo_clip (0.2 below, 0.28 above; never active on TRL's side, whose batches are on-policy);
    - AdamW with trainer.betas / weight_decay / grad_clip, the recipe's schedule (cosine or constant) with its
      warm-up steps, decaying over the same number of steps;
    - fp32 on the CPU (pipelinerl's default there), or bf16 autocast where the recipe sets
      trainer.mixed_precision=bf16 (TRL's `bf16`: accelerate's autocast, which its generation runs under too);
      no gradient checkpointing, no checkpoints, no reporting.
    TRL's own choices stay: advantages (r - group mean) / (group std + 1e-4), the loss averaged over the batch's
    tokens ("dapo"), no dynamic sampling (groups whose answers are all right or all wrong count as samples)."""
    from trl import GRPOConfig

    t, s = cfg.trainer, cfg.sampling
    if s.stop:
        raise ValueError("sampling.stop: TRL's transformers generation here has no stop strings; this benchmark "
                         "supports recipes without them")
    return GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=t.mixed_precision == "bf16", fp16=False,
        gradient_checkpointing=False,
        seed=cfg.seed, data_seed=cfg.seed, learning_rate=lr, max_steps=steps,
        lr_scheduler_type="cosine" if t.schedule == "cosine" else "constant_with_warmup", warmup_steps=t.warmup_steps,
        adam_beta1=float(t.betas[0]), adam_beta2=float(t.betas[1]), weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip, per_device_train_batch_size=t.samples_per_step, gradient_accumulation_steps=1,
        generation_batch_size=t.samples_per_step, num_iterations=1, num_generations=s.group_size,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        beta=t.kl_coef, epsilon=0.2 if t.clip_low is None else t.clip_low,
        epsilon_high=0.28 if t.clip_high is None else t.clip_high,
        save_strategy="no", report_to="none", logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False)


def hf_evaluate(model, tokenizer, task, problems: list[dict], scorer, reward_fn, k: int, temperature: float,
                top_p: float, top_k: int, max_new_tokens: int, seed: int, max_sequences: int = 256) -> dict:
    """Held-out evaluation of a transformers model as pipelinerl's evaluation does it (pipelinerl.eval:
    `summarize`'s avg@k per benchmark and their mean), with transformers' sampling: k samples per problem at the
    given temperature, each scored by the task's verifier through `scorer` (a RewardPool or InProcessScorer).
    Torch's random state is forked, so evaluating does not change the training's sampling."""
    import torch
    from transformers import GenerationConfig

    from pipelinerl.eval import benchmark_names, summarize
    from pipelinerl.tasks import reward_item

    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or [tokenizer.eos_token_id]))
    names = benchmark_names(list(dict.fromkeys(str(p.get("source") or task.name) for p in problems)))
    gen = GenerationConfig(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                           top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, num_return_sequences=k,
                           eos_token_id=sorted(eos_ids), pad_token_id=tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    rows = []
    per_call = max(1, max_sequences // k)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), per_call):
            chunk = problems[start:start + per_call]
            enc = tokenizer([task.prompt(p) for p in chunk], return_tensors="pt", padding=True)
            out = model.generate(**enc, generation_config=gen)[:, enc["input_ids"].shape[1]:].tolist()
            items, lengths = [], []
            for i, problem in enumerate(chunk):
                for ids in out[i * k:(i + 1) * k]:
                    end = next((j for j, tok in enumerate(ids) if tok in eos_ids), None)
                    written = ids if end is None else ids[:end + 1]
                    finish = "length" if end is None else "stop"
                    text = tokenizer.decode(written, skip_special_tokens=True)
                    items.append(reward_item(problem, text, finish))
                    lengths.append(len(written))
            results = scorer.score(reward_fn, items)
            for i, problem in enumerate(chunk):
                mine = results[i * k:(i + 1) * k]
                rows.append({"id": problem.get("id"), "benchmark": names[str(problem.get("source") or task.name)],
                             "correct": [float(r.parts.get("correct", r.reward > 0)) for r in mine],
                             "tokens": lengths[i * k:(i + 1) * k],
                             "truncated": [it["finish_reason"] == "length" for it in items[i * k:(i + 1) * k]]})
    model.train(was_training)
    return summarize(rows, k)


class InProcessScorer:
    """RewardPool's `score` without its worker processes: the TRL side calls the task's verifier directly, as a TRL
    reward function does (the pool's process isolation is for untrusted code, which these workloads do not run)."""

    @staticmethod
    def score(fn: Callable[[dict], Any], items: list[dict]) -> list:
        from pipelinerl.rewards.pool import to_result

        return [to_result(fn(item)) for item in items]


def held_out_setup(cfg) -> tuple[Any, Callable[[dict], Any], list[dict], dict]:
    """What a held-out evaluation of `cfg`'s task needs: the task, its verifier (task.reward_fn's replacement where
    set), the held-out problems and evaluation's sampling as pipelinerl's trainer takes it (train.HeldOutEval,
    not imported: its module would load pipelinerl's trainer): `eval.<x>` where set, else `sampling.<x>`."""
    from pipelinerl.rewards.pool import resolve
    from pipelinerl.tasks import task_from_config

    task = task_from_config(cfg.task)
    reward_fn = resolve(cfg.task.reward_fn) if cfg.task.reward_fn else task.reward_fn
    e, s = cfg.eval, cfg.sampling
    sampling = {"temperature": s.temperature if e.temperature is None else e.temperature,
                "top_p": s.top_p if e.top_p is None else e.top_p, "top_k": s.top_k,
                "max_new_tokens": s.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens}
    return task, reward_fn, task.eval_problems(), sampling


def eval_worker(spec: dict) -> int:
    """Held-out evaluations of saved models (in its own process, as TRL's side evaluates in its own): for each
    [step, path] of spec["models"], `hf_evaluate` as TRL's side calls it at that step; a row per model to
    spec["out"]."""
    from pipelinerl.config import load_config

    cfg = load_config(spec["recipe"], spec["overrides"])
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task, reward_fn, held_out, sampling = held_out_setup(cfg)
    with open(spec["out"], "w") as out:
        for step, path in spec["models"]:
            tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            t = time.monotonic()
            result = hf_evaluate(model, tokenizer, task, held_out, InProcessScorer(), reward_fn, cfg.trainer.eval_k,
                                 sampling["temperature"], sampling["top_p"], sampling["top_k"],
                                 sampling["max_new_tokens"], seed=cfg.seed + step)
            n = result["summary"]["samples_per_problem"]
            out.write(json.dumps({"step": step, "eval_accuracy": result["summary"][f"avg@{n}"],
                                  "eval_seconds": time.monotonic() - t}) + "\n")
            out.flush()
    return 0


def evaluate_exports(recipe: Path, run_dir: Path, overrides: list[str], base: Path, curves: dict,
                     threads: int) -> tuple[list[dict], float]:
    """A pipelinerl run's held-out curve from its exports (RUN_DIR/exports/step_N, `trainer.export_every`) and the
    base model as step 0, evaluated after the run by `eval_worker`; each point on the run's clocks at its step (the
    row of step N, written before N's export). Returns (evals, evaluation seconds). The exports are deleted after."""
    clocks = {0: curves["start"]}
    for r in curves["steps"]:
        clocks[r["step"]] = {k: r[k] for k in ("train_s", "launch_s") if k in r}
    exports = sorted((int(p.name.removeprefix("step_")), p) for p in (run_dir / "exports").glob("step_*"))
    models = [[0, str(base)], *[[step, str(p)] for step, p in exports if step in clocks]]
    out = run_dir / "export_evals.jsonl"
    spec = {"recipe": str(recipe), "overrides": overrides, "threads": threads, "models": models, "out": str(out)}
    (run_dir / "eval_spec.json").write_text(json.dumps(spec, indent=1))
    log = run_dir.parent / f"{run_dir.name}.eval.log"
    with open(log, "wb") as f:
        code = subprocess.call([sys.executable, "-m", "bench.vs_trl", "--eval-worker", str(run_dir / "eval_spec.json")],
                               stdout=f, stderr=subprocess.STDOUT, env=subprocess_env(threads), cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"evaluating the exports of {run_dir} failed (exit {code}); log {log}:\n{_tail(log)}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shutil.rmtree(run_dir / "exports", ignore_errors=True)  # 1 model per evaluation: disk a grid need not keep
    evals = [{"step": r["step"], "accuracy": r["eval_accuracy"], **clocks[r["step"]]} for r in rows]
    return evals, sum(r["eval_seconds"] for r in rows)


def trl_worker(spec: dict) -> int:
    """One TRL run (in its own process, so that its threads, memory and imports are its own): writes
    RUN_DIR/trl_metrics.jsonl, a row per step and one per held-out evaluation, on the benchmark's clocks."""
    launch_wall = spec["launch_wall"]
    from pipelinerl.config import load_config

    cfg = load_config(spec["recipe"], spec["overrides"])
    import torch

    torch.set_num_threads(spec.get("threads") or trainer_cores(cfg))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from pipelinerl.rewards.shaping import shape_reward
    from pipelinerl.tasks import reward_item

    run_dir = Path(spec["run_dir"])
    task, reward_fn, held_out, sampling = held_out_setup(cfg)
    if hasattr(task, "rollout"):
        raise ValueError(f"task {cfg.task.name}: multi-turn tasks have no TRL counterpart in this benchmark")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or [tokenizer.eos_token_id]))
    train = Dataset.from_list([{"prompt": task.prompt(p), "problem": json.dumps(p)} for p in task.train_problems()])
    out = open(run_dir / "trl_metrics.jsonl", "a")

    def write(row: dict) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    scorer = InProcessScorer()

    def task_reward(prompts: list, completions: list[str], completion_ids: list[list[int]], problem: list[str],
                    trainer_state=None, **_: Any) -> list[float]:
        """The task's verifier, called in this process as a TRL reward function is, shaped as the recipe's
        `reward:` says: the reward pipelinerl's actor gives the same completion."""
        finishes = ["stop" if ids and ids[-1] in eos_ids else "length" for ids in completion_ids]
        items = [reward_item(json.loads(p), c, f) for p, c, f in zip(problem, completions, finishes)]
        step = trainer_state.global_step if trainer_state is not None else 0
        rewards = []
        for res, ids, finish in zip(scorer.score(reward_fn, items), completion_ids, finishes):
            correct = bool(res.parts.get("correct", res.reward > 0))
            rewards.append(shape_reward(res.reward, correct, len(ids), finish, cfg.sampling.max_new_tokens, step,
                                        cfg.reward)[0])
        return rewards

    class HeldOut(TrainerCallback):
        """Evaluates before the first step, every eval_every steps and after the last, off the clock."""

        def __init__(self) -> None:
            self.t0, self.eval_s = 0.0, 0.0
            self.accuracies: list[float] = []

        def clocks(self) -> dict:
            return {"train_s": time.monotonic() - self.t0 - self.eval_s,
                    "launch_s": time.time() - launch_wall - self.eval_s}

        def evaluate(self, model, step: int) -> None:
            clocks, t = self.clocks(), time.monotonic()
            result = hf_evaluate(model, tokenizer, task, held_out, scorer, reward_fn, cfg.trainer.eval_k,
                                 sampling["temperature"], sampling["top_p"], sampling["top_k"],
                                 sampling["max_new_tokens"], seed=cfg.seed + step)
            seconds = time.monotonic() - t
            self.eval_s += seconds
            n = result["summary"]["samples_per_problem"]
            self.accuracies.append(result["summary"][f"avg@{n}"])
            write({"step": step, "eval_accuracy": self.accuracies[-1], "eval_seconds": seconds,
                   "eval_output_tokens_mean": result["benchmarks"][0].get("mean_output_tokens"), **clocks})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.t0 = time.monotonic()
            write({"step": 0, "train_begin_launch_s": time.time() - launch_wall})
            if spec["eval_every"] > 0:
                self.evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            write({"step": step, "samples": cfg.trainer.samples_per_step, **self.clocks()})
            if spec["eval_every"] > 0 and (step % spec["eval_every"] == 0 or step == state.max_steps):
                self.evaluate(model, step)
                if diverged(self.accuracies):  # as pipelinerl's side is stopped
                    write({"step": step, "stopped": "diverged"})
                    control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            write({"step": state.global_step, "log": {k: v for k, v in (logs or {}).items()
                                                      if isinstance(v, (int, float))}})

    try:
        trainer = GRPOTrainer(model=model, reward_funcs=task_reward, train_dataset=train, processing_class=tokenizer,
                              args=trl_config(cfg, spec["lr"], spec["steps"], run_dir / "trl_output"),
                              callbacks=[HeldOut()])
        trainer.train()
    finally:
        out.close()
    return 0


def run_trl(recipe: Path, run_dir: Path, overrides: list[str], lr: float, steps: int, eval_every: int,
            threads: int, budget_s: float) -> dict:
    """One TRL run in its own process (`trl_worker`); stopped like pipelinerl's runs when it diverges (inside) or
    outlives `budget_s` (from here)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    launch_wall = time.time()
    spec = {"recipe": str(recipe), "overrides": overrides, "lr": lr, "steps": steps, "eval_every": eval_every,
            "run_dir": str(run_dir), "launch_wall": launch_wall, "threads": threads}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    stopped = None
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bench.vs_trl", "--trl-worker", str(run_dir / "spec.json")],
                                stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(threads), cwd=ROOT)
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            stopped = f"over its budget of {budget_s:.0f} s"
            proc.kill()
            proc.wait(60)
    wall = time.time() - launch_wall
    if proc.returncode != 0 and not stopped:
        raise RuntimeError(f"TRL run in {run_dir} failed (exit {proc.returncode}); log {log}:\n{_tail(log)}")
    rows = []
    for line in (run_dir / "trl_metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed worker
            continue
    stopped = stopped or next((r["stopped"] for r in rows if "stopped" in r), None)
    evals = [{"step": r["step"], "accuracy": r["eval_accuracy"], "train_s": r["train_s"], "launch_s": r["launch_s"]}
             for r in rows if "eval_accuracy" in r]
    step_rows = [r for r in rows if "samples" in r]
    logs = [r["log"] for r in rows if "log" in r]
    zero_std = [lg["frac_reward_zero_std"] for lg in logs if "frac_reward_zero_std" in lg]
    lengths = [lg["completions/mean_length"] for lg in logs if "completions/mean_length" in lg]
    return {"evals": evals, "steps": step_rows, "wall_s": wall, "log": str(log), "stopped": stopped,
            "eval_seconds_total": sum(r.get("eval_seconds", 0.0) for r in rows),
            "groups_zero_std_frac": sum(zero_std) / len(zero_std) if zero_std else None,
            "output_tokens_mean": sum(lengths) / len(lengths) if lengths else None}


def probe_trl_threads(recipe: Path, base: Path, lr: float, work: Path, candidates: Sequence[int],
                      extra: Sequence[str] = (), steps: int = 16) -> tuple[int, dict[int, float]]:
    """TRL's torch thread count, tuned as a careful user would: a short run (no evaluation) with each candidate,
    the one with the fewest seconds per step wins. (On a shared machine two OpenMP threads can be several times
    slower than one: a thread that loses its core stalls the other at every barrier.)"""
    timings = {}
    for threads in dict.fromkeys(candidates):
        run_dir = work / f"trl-threads{threads}-probe"
        overrides = [*extra, *common_overrides(base, lr, steps, 0), f"run_dir={run_dir}"]
        result = run_trl(recipe, run_dir, overrides, lr, steps, 0, threads, budget_s=24 * 3600.0)
        timings[threads] = seconds_per_step(result["steps"], skip_frac=0.25)
    return min(timings, key=lambda t: timings[t]), timings


# --- one workload ---------------------------------------------------------------------------------------------------

def compare_workload(recipe: Path, lrs: dict[str, list[float]] | None = None, steps: int | None = None,
                     eval_every: int | None = None, target_fraction: float = 0.9, trl_threads: int | None = None,
                     extra: Sequence[str] = (), reuse: bool = False, budget_s: float | None = None,
                     out_dir: Path = RESULTS_DIR, pipelinerl_extra: Sequence[str] = (),
                     seed: int | None = None) -> dict:
    """Both sides' learning-rate grids on one recipe, interleaved (pipelinerl, TRL, pipelinerl, ...) so that drift
    in the machine's load hits both alike; writes vs_trl_<workload>.json and .png into `out_dir`.

    `lrs` maps a side to its grid (a side left out does not run). `trl_threads`: torch threads of the TRL process;
    by default `probe_trl_threads` picks 1 or the cores pipelinerl computes with. `extra`: recipe overrides for both
    sides and the base model, e.g. model.warmup_steps=0 for a smoke test; they get their own working directory, so
    a cached base model of the recipe as written is never replaced. `reuse`: take a run's result from an earlier
    invocation where one with the same settings is saved (to add learning rates to a grid without rerunning it).
    `budget_s`: the wall time a run may take before it is stopped (default: 3x the longest run finished so far in
    this grid, none before the first), so that a run which stalls cannot hold the grid up for hours.
    `pipelinerl_extra`: overrides for pipelinerl's runs only, its own algorithm's options (such as
    actor.dynamic_sampling=true): the base model and TRL's runs stay those of the grid without them, so TRL's runs
    can be reused; pipelinerl's runs and the results get names of their own. `seed`: both sides' runs with this
    seed instead of the recipe's (a repeat of the grid), from the same base model, built with the recipe's seed;
    the runs and the results get names of their own."""
    from pipelinerl.config import load_config

    recipe = Path(recipe).resolve()
    name = recipe.stem
    extra = list(extra)
    cfg = load_config(recipe, [*extra, "run_dir=unused"])
    steps = steps or cfg.trainer.max_steps
    eval_every = eval_every or max(1, steps // 20)
    lrs = lrs or {side: lr_grid(cfg.trainer.lr) for side in SIDES}
    work = WORK_DIR / (name if not extra else f"{name}-{hashlib.sha1(' '.join(extra).encode()).hexdigest()[:8]}")
    # runs of another length than the recipe's (--quick, --steps) or another seed (--seed) are their own workload's:
    # their files never replace those of the recipe's own
    variant = "" if steps == cfg.trainer.max_steps else f"-{steps}steps"
    pipelinerl_extra = list(pipelinerl_extra)
    own = f"-p{hashlib.sha1(' '.join(pipelinerl_extra).encode()).hexdigest()[:8]}" if pipelinerl_extra else ""
    # a repeat with another seed: the runs' seed changes, the base model's stays the recipe's (model.seed)
    repeat = [] if seed is None or seed == cfg.seed else [f"seed={seed}", f"model.seed={cfg.seed}"]
    family = work.name + variant + own  # the name of this comparison's seeds pooled (`compare_seeds`)
    variant += f"-seed{seed}" if repeat else ""
    label = work.name + variant + own
    t_base = time.perf_counter()
    # without overrides, the base model other benchmarks of this recipe use (bench/common.cached_base_model): the
    # heavier recipe's warm-up takes long enough to run once per machine
    base_path = work / "base_model" if extra else cached_base_model(recipe)
    print(f"[{name}] base model in {base_path}", flush=True)
    base = prepare_base_model(recipe, base_path, extra)
    base_seconds = time.perf_counter() - t_base
    params = model_size(base)
    # what a saved result must have been run with to be reused: the same base model (its marker), steps, evaluation
    # and overrides
    marker = base / "pipelinerl_base_model.json"
    model_settings = {"base_model": marker.read_text() if marker.exists() else str(base), "extra": extra}
    same = {**model_settings, "steps": steps, "eval_every": eval_every}

    def saved(path: Path, settings: dict) -> dict | None:
        if reuse and path.exists():
            data = json.loads(path.read_text())
            if data.get("settings") == settings:
                return data["result"]
        return None

    threads_probe = None
    probe_file = work / "trl-threads-probe.json"
    if trl_threads:
        threads = trl_threads
    elif "trl" in lrs:
        found = saved(probe_file, model_settings)
        if found:
            threads, threads_probe = found["threads"], {int(k): v for k, v in found["probe"].items()}
        else:
            print(f"[{name}] timing TRL with 1 and {trainer_cores(cfg)} torch threads", flush=True)
            threads, threads_probe = probe_trl_threads(recipe, base, lrs["trl"][0], work, (1, trainer_cores(cfg)),
                                                       extra)
            probe_file.write_text(json.dumps({"settings": model_settings, "result": {"threads": threads,
                                                                                      "probe": threads_probe}}))
        print(f"[{name}]   seconds per step by torch threads: "
              f"{ {t: round(v, 3) for t, v in threads_probe.items()} }: TRL runs with {threads}", flush=True)
    else:
        threads = trainer_cores(cfg)
    runs: list[dict] = []
    for i in range(max(len(v) for v in lrs.values())):
        for side in SIDES:
            if i >= len(lrs.get(side, [])):
                continue
            lr = lrs[side][i]
            run_dir = work / f"{side}-lr{lr:g}{variant}{own if side == 'pipelinerl' else ''}"
            result_file = run_dir.with_name(run_dir.name + ".result.json")
            settings = {**same, **({"trl_threads": threads} if side == "trl" else {})}
            overrides = [*extra, *repeat, *common_overrides(base, lr, steps, eval_every)]
            if side == "pipelinerl":  # evaluated after the run, from its exports (the module's docstring)
                settings["pipelinerl_evaluation"] = "exports"
                overrides += ["trainer.eval_every=0", f"trainer.export_every={eval_every}"]
            if side == "pipelinerl" and pipelinerl_extra:
                settings["pipelinerl_extra"] = pipelinerl_extra
                overrides += pipelinerl_extra
            run = saved(result_file, settings)
            if run:
                print(f"[{name}] {side} lr {lr:g}: reusing {result_file}", flush=True)
            else:
                limit = budget_s or (3 * max(run_cost_s(r) for r in runs) if runs else 24 * 3600.0)
                print(f"[{name}] {side} lr {lr:g}: {steps} steps, held-out evaluation every {eval_every}, "
                      f"stopped after {limit:.0f} s", flush=True)
                load_before = os.getloadavg()[0]
                if side == "pipelinerl":
                    result = run_pipelinerl(recipe, run_dir, overrides, limit)
                    result["evals"], result["eval_seconds_total"] = evaluate_exports(
                        recipe, run_dir, overrides, base, result, threads)
                    result["evaluated"] = "exports"
                else:
                    result = run_trl(recipe, run_dir, overrides + [f"run_dir={run_dir}"], lr, steps, eval_every,
                                     threads, limit)
                sps = seconds_per_step(result["steps"])
                run = {"side": side, "lr": lr, "run_dir": str(run_dir), **result, "seconds_per_step": sps,
                       "samples_per_s": cfg.trainer.samples_per_step / sps if sps else None,
                       "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
                result_file.write_text(json.dumps({"settings": settings, "result": run}))
            runs.append(run)
            start, final = ((run["evals"][0]["accuracy"], run["evals"][-1]["accuracy"]) if run["evals"]
                            else (float("nan"), float("nan")))
            print(f"[{name}]   held-out {start:.3f} -> {final:.3f}"
                  f"{' (stopped: ' + run['stopped'] + ')' if run.get('stopped') else ''}, "
                  f"{1000 * (run['seconds_per_step'] or float('nan')):.0f} ms/step, {run['wall_s']:.0f} s in all",
                  flush=True)
    result = summarise_workload(label, recipe, cfg, runs, params, threads, steps, eval_every, target_fraction)
    result["settings"].update(trl_threads_probe_s_per_step=threads_probe, recipe_overrides=extra,
                              pipelinerl_overrides=pipelinerl_extra, seed=cfg.seed if seed is None else seed)
    own_cfg = load_config(recipe, [*extra, *pipelinerl_extra, "run_dir=unused"])  # as pipelinerl's side ran
    result["settings"]["pipelinerl_threads"] = (f"{own_cfg.engine.threads} per engine, "
                                                f"{own_cfg.trainer.threads} per trainer")
    result["base_model"] = {"path": str(base), "parameters": params, "seconds_to_prepare": round(base_seconds, 1)}
    result["seeds_family"] = family
    out_dir.mkdir(parents=True, exist_ok=True)
    result["png"] = str(plot_workload(label, runs, result, out_dir / f"vs_trl_{label}.png"))
    result["json"] = str(out_dir / f"vs_trl_{label}.json")
    Path(result["json"]).write_text(json.dumps(result, indent=2) + "\n")
    return result


def summarise_workload(name: str, recipe: Path, cfg, runs: list[dict], params: int, threads: int, steps: int,
                       eval_every: int, target_fraction: float) -> dict:
    from pipelinerl.tasks import task_from_config

    main = analyse(runs, target_fraction, "launch_s")
    train_clock = analyse(runs, target_fraction, "train_s")
    sensitivity = {f"{f:g}": analyse(runs, f, "launch_s")["ratio"] for f in (0.5, 0.75, 1.0)}
    heavy = is_heavy(params, cfg.sampling.max_new_tokens)
    target_ratio = 2.0 if heavy else 1.0
    # pipelinerl's actor generates during its trainer's evaluations, at most max_lag + 1 batches ahead
    overlap = None
    best_p = main.get("best", {}).get("pipelinerl")
    if best_p:
        run = next(r for r in runs if r["side"] == "pipelinerl" and r["lr"] == best_p["lr"])
        evals_before = 0 if run.get("evaluated") == "exports" else \
            sum(1 for e in run["evals"] if e["launch_s"] < best_p["seconds_to_target"])
        overlap = evals_before * (cfg.actor.max_lag + 1) * (run["seconds_per_step"] or 0.0)
    ratio = main["ratio"]
    worst = None
    if ratio is not None and overlap is not None:
        t_trl = main["best"]["trl"]["seconds_to_target"]
        worst = t_trl / (best_p["seconds_to_target"] + overlap)

    def row(r: dict) -> dict:
        return {"side": r["side"], "lr": r["lr"],
                "held_out": [[e["step"], round(e["accuracy"], 4), round(e["launch_s"], 1), round(e["train_s"], 1)]
                             for e in r["evals"]],
                "seconds_per_step": r["seconds_per_step"], "samples_per_s": r["samples_per_s"],
                "wall_s": round(r["wall_s"], 1), "eval_seconds_total": round(r["eval_seconds_total"], 1),
                "output_tokens_mean": r.get("output_tokens_mean"), "load_average_1m_start_end": r["load_average_1m"],
                "stopped": r.get("stopped"), "evaluated": r.get("evaluated", "in the run"),
                **({"groups_dropped_frac": r.get("groups_dropped_frac")} if r["side"] == "pipelinerl" else
                   {"groups_zero_std_frac": r.get("groups_zero_std_frac")}),
                "log": r["log"]}

    best = main.get("best", {})
    summary = (f"{name}: TRL {_fmt_s(best.get('trl'))} vs pipelinerl {_fmt_s(best.get('pipelinerl'))} to held-out "
               f"{_fmt_acc(main.get('target_accuracy'))}" + (f" (ratio {ratio:.2f})" if ratio is not None else
                                                           f" ({main.get('why', 'a side never reached it')})"))
    return {
        "workload": name, "recipe": str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT) else str(recipe),
        "heavy": heavy, "ratio": ratio, "target": target_ratio, "passed": bool(ratio is not None and
                                                                              ratio >= target_ratio),
        "summary": summary,
        "target_accuracy": main.get("target_accuracy"), "base_accuracy": main["base_accuracy"],
        "best_final_accuracy": main["best_final_accuracy"], "target_fraction": target_fraction,
        "seconds_to_target": {side: (best[side]["seconds_to_target"] if side in best else None) for side in SIDES},
        "best_lr": {side: (best[side]["lr"] if side in best else None) for side in SIDES},
        "ratio_train_clock": train_clock["ratio"], "ratio_by_target_fraction": sensitivity,
        "pipelinerl_eval_overlap_bound_s": overlap, "ratio_worst_case": worst,
        "per_run_to_target": main.get("per_run"), "grid": [row(r) for r in runs],
        "settings": {"steps": steps, "eval_every": eval_every, "eval_k": cfg.trainer.eval_k,
                     "eval_problems": (len(task_from_config(cfg.task).eval_problems())
                                       if cfg.task.name == "arithmetic" else None),
                     "samples_per_step": cfg.trainer.samples_per_step, "group_size": cfg.sampling.group_size,
                     "max_new_tokens": cfg.sampling.max_new_tokens, "trl_torch_threads": threads,
                     "pipelinerl_threads": f"{cfg.engine.threads} per engine, {cfg.trainer.threads} per trainer",
                     "clock": "launch_s: from the command's start, held-out evaluations left out (both sides)",
                     "evaluation": "TRL: in its process between steps; pipelinerl: its exports, after the run "
                                   "(each run's `evaluated`), both by hf_evaluate with seed + step",
                     "held_out": "[step, accuracy, launch_s, train_s]"},
        "machine": machine(),
    }


def compare_seeds(recipe: Path, seeds: Sequence[int], target_fraction: float = 0.9, out_dir: Path = RESULTS_DIR,
                  **kwargs: Any) -> dict:
    """`compare_workload` once per seed, then the seeds pooled (`summarise_seeds`); writes
    vs_trl_<workload>-seeds<a>_<b>_....json and .png beside each seed's own files. `kwargs` go to compare_workload
    (with --reuse, the seeds already run are read back, so seeds can be added one invocation at a time)."""
    per_seed = [compare_workload(recipe, target_fraction=target_fraction, out_dir=out_dir, seed=seed, **kwargs)
                for seed in seeds]
    result = summarise_seeds(per_seed, list(seeds), target_fraction)
    label = result["workload"]
    out_dir.mkdir(parents=True, exist_ok=True)
    result["png"] = str(plot_seeds(label, per_seed, result, out_dir / f"vs_trl_{label}.png"))
    result["json"] = str(out_dir / f"vs_trl_{label}.json")
    Path(result["json"]).write_text(json.dumps(result, indent=2) + "\n")
    return result


def summarise_seeds(per_seed: Sequence[dict], seeds: Sequence[int], target_fraction: float = 0.9) -> dict:
    """The verdict over several seeds of one comparison (each a `compare_workload` result): the ratio on the
    seeds' mean curves (`pool_seeds`), with its spread over resampled seeds (`seed_bootstrap`), and each seed's own
    ratio beside it. The pooled ratio is the one held against the target."""
    grids = [grid_runs(r) for r in per_seed]
    pooled = pool_seeds(grids)
    main = analyse(pooled, target_fraction)
    first = per_seed[0]
    ratio, target_ratio = main["ratio"], first["target"]
    best = main.get("best", {})
    label = f"{first['seeds_family']}-seeds{'_'.join(str(s) for s in seeds)}"
    seed_ratios = [r["ratio"] for r in per_seed]
    known = [x for x in seed_ratios if x is not None]
    spread = seed_bootstrap(grids, target_fraction)
    summary = (f"{label}: mean curves of {len(seeds)} seeds, TRL {_fmt_s(best.get('trl'))} vs pipelinerl "
               f"{_fmt_s(best.get('pipelinerl'))} to held-out {_fmt_acc(main.get('target_accuracy'))}"
               + (f" (ratio {ratio:.2f}; 90% of resampled seeds {spread['p05']:.2f}-{spread['p95']:.2f}; each seed "
                  f"{', '.join('-' if x is None else f'{x:.2f}' for x in seed_ratios)})" if ratio is not None
                  else f" ({main.get('why', 'a side never reached it')})"))
    return {
        "workload": label, "recipe": first["recipe"], "heavy": first["heavy"], "seeds": list(seeds),
        "ratio": ratio, "target": target_ratio, "passed": bool(ratio is not None and ratio >= target_ratio),
        "ratio_is": "TRL / pipelinerl seconds to the target on each side's mean held-out curve over the seeds",
        "summary": summary, "target_accuracy": main.get("target_accuracy"), "base_accuracy": main["base_accuracy"],
        "best_final_accuracy": main["best_final_accuracy"], "target_fraction": target_fraction,
        "seconds_to_target": {side: (best[side]["seconds_to_target"] if side in best else None) for side in SIDES},
        "best_lr": {side: (best[side]["lr"] if side in best else None) for side in SIDES},
        "ratio_by_target_fraction": {f"{f:g}": analyse(pooled, f)["ratio"] for f in (0.5, 0.75, 1.0)},
        "ratio_seed_bootstrap": spread, "ratio_per_seed": dict(zip((str(s) for s in seeds), seed_ratios)),
        "ratio_per_seed_median": median(known) if known else None,
        "per_run_to_target": main.get("per_run"),
        "grid": [{"side": r["side"], "lr": r["lr"],
                  "held_out": [[e["step"], round(e["accuracy"], 4), round(e["launch_s"], 1), round(e["train_s"], 1)]
                               for e in r["evals"]],
                  **{key: _mean([row[key] for res in per_seed for row in res["grid"]
                                 if (row["side"], row["lr"]) == (r["side"], r["lr"])])
                     for key in ("seconds_per_step", "samples_per_s")}}
                 for r in pooled],
        "per_seed_json": [r.get("json") for r in per_seed],
        "settings": {**{k: v for k, v in first["settings"].items() if k != "seed"},
                     "pooling": "mean held-out accuracy and mean clock over the seeds, at the steps every seed's "
                                "run evaluated; spread: 2000 resamples of the seeds with replacement"},
        "machine": first["machine"],
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def plot_seeds(name: str, per_seed: Sequence[dict], result: dict, out: Path) -> Path:
    """Each side's mean held-out curve over the seeds (bold) and every seed's own (thin), against wall-clock seconds
    and against steps; the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pipelinerl": "tab:blue", "trl": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in per_seed:
        for r in res["grid"]:
            if r["lr"] != result["best_lr"].get(r["side"]):
                continue
            for ax, col in zip(axes, (2, 0)):
                ax.plot([h[col] for h in r["held_out"]], [h[1] for h in r["held_out"]], color=colors[r["side"]],
                        lw=0.8, alpha=0.35)
    for r in result["grid"]:
        if r["lr"] != result["best_lr"].get(r["side"]):
            continue
        label = f"{r['side']} lr {r['lr']:g}, mean of {len(per_seed)} seeds"
        for ax, col in zip(axes, (2, 0)):
            ax.plot([h[col] for h in r["held_out"]], [h[1] for h in r["held_out"]], color=colors[r["side"]], lw=2.4,
                    marker="o", ms=3, label=label)
    return _finish_plot(fig, axes, name, result, out, " on the mean curves")


def _finish_plot(fig: Any, axes: Any, name: str, result: dict, out: Path, ratio_note: str = "") -> Path:
    """The two panels' target line, labels and title (the ratio, with `ratio_note`), saved to `out`."""
    import matplotlib.pyplot as plt

    for ax, xlabel in zip(axes, ("seconds since the command started (held-out evaluations left out)", "step")):
        if result.get("target_accuracy") is not None:
            ax.axhline(result["target_accuracy"], color="gray", ls="--", lw=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out pass@1 (temperature 1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ratio = result.get("ratio")
    fig.suptitle(f"{name}: pipelinerl vs TRL GRPOTrainer" + (f", TRL time / pipelinerl time = {ratio:.2f}{ratio_note}"
                                                             if ratio is not None else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _fmt_s(best: dict | None) -> str:
    return f"{best['seconds_to_target']:.0f} s (lr {best['lr']:g})" if best else "never"


def _fmt_acc(acc: float | None) -> str:
    return "-" if acc is None else f"{acc:.3f}"


def plot_workload(name: str, runs: list[dict], result: dict, out: Path) -> Path:
    """Held-out accuracy against wall-clock seconds (launch clock, evaluations left out) and against steps, every
    run of the grid; each side's best run bold, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pipelinerl": "tab:blue", "trl": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    best_lr = result["best_lr"]
    for r in runs:
        bold = best_lr.get(r["side"]) == r["lr"]
        label = f"{r['side']} lr {r['lr']:g}" + (" (best)" if bold else "")
        style = {"color": colors[r["side"]], "lw": 2.2 if bold else 0.9, "alpha": 1.0 if bold else 0.45,
                 "marker": "o", "ms": 3 if bold else 2}
        axes[0].plot([e["launch_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], label=label, **style)
        axes[1].plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], label=label, **style)
    return _finish_plot(fig, axes, name, result, out)


# --- entry points ---------------------------------------------------------------------------------------------------

def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


QUICK_STEPS = 300


def quick_lrs(recipe: Path = TINY_RECIPE) -> dict[str, list[float]]:
    """One lr per side for --quick: each side's best in the last full comparison on this recipe
    (bench/results/vs_trl_<recipe>.json), else the recipe's."""
    from pipelinerl.config import load_config

    lr = load_config(recipe, ["run_dir=unused"]).trainer.lr
    saved = RESULTS_DIR / f"vs_trl_{recipe.stem}.json"
    best = json.loads(saved.read_text()).get("best_lr", {}) if saved.exists() else {}
    return {side: [best.get(side) or lr] for side in SIDES}


def run(quick: bool = False) -> dict:
    """For `python -m bench`: quick = the tiny recipe only, one lr per side (`quick_lrs`), 300 steps (about 3
    minutes); otherwise every workload with its full grid. The top-level ratio and target are those of the workload
    furthest from its target."""
    if not trl_available():
        return {"skipped": TRL_MISSING, "ratio": 0.0, "target": 1.0, "passed": False}
    if quick:
        results = {TINY_RECIPE.stem: compare_workload(TINY_RECIPE, quick_lrs(), steps=QUICK_STEPS, eval_every=50)}
    else:
        results = {r.stem: compare_workload(r) for r in default_recipes()}
    return combine(results)


def combine(results: dict[str, dict]) -> dict:
    def margin(r: dict) -> float:
        return (r["ratio"] or 0.0) / r["target"]

    binding = min(results.values(), key=margin)
    return {"ratio": binding["ratio"] or 0.0, "target": binding["target"],
            "passed": all(r["passed"] for r in results.values()),
            "summary": "; ".join(r["summary"] for r in results.values()),
            "workloads": results, "machine": machine()}


def default_recipes() -> list[Path]:
    recipes = [TINY_RECIPE]
    if HEAVY_RECIPE.exists():
        recipes.append(HEAVY_RECIPE)
    else:
        print(f"note: {HEAVY_RECIPE.relative_to(ROOT)} does not exist; only the tiny workload runs", file=sys.stderr)
    return recipes


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", action="append", default=None,
                        help="a recipe to compare on (repeatable); default: recipes/tiny_cpu.yaml, then "
                             "recipes/counting_cpu.yaml")
    parser.add_argument("--lrs-pipelinerl", default="", help="comma-separated lrs (default: recipe lr x 1/10, 1/3, "
                        "1, 3)")
    parser.add_argument("--lrs-trl", default="", help="comma-separated lrs (default: as pipelinerl's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations "
                        "(default: steps / 20)")
    parser.add_argument("--target-fraction", type=float, default=0.9,
                        help="target = base + this fraction of the way to the lower side's best final accuracy")
    parser.add_argument("--trl-threads", type=int, default=None, help="torch threads of the TRL process (default: "
                        "timed before the grid, 1 or the recipe's engine + trainer threads, whichever is faster)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for both sides and the base model (repeatable), e.g. "
                             "model.warmup_steps=0 for a smoke test; runs in its own working directory")
    parser.add_argument("--set-pipelinerl", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for pipelinerl's runs only (repeatable), e.g. "
                             "actor.dynamic_sampling=true; TRL's runs and the base model stay as without it")
    parser.add_argument("--seed", type=int, default=None, help="both sides' runs with this seed (default: the "
                        "recipe's): a repeat from the same base model, its runs and results named apart")
    parser.add_argument("--seeds", default="", help="comma-separated seeds: the comparison once per seed, then "
                        "judged on each side's mean curve over them (with --reuse, seeds already run are read back)")
    parser.add_argument("--reuse", action="store_true", help="take each run's result from an earlier invocation "
                        "with the same settings where one is saved (runs/vs_trl/<recipe>/*.result.json)")
    parser.add_argument("--run-budget-s", type=float, default=None, help="stop a run after this many seconds "
                        "(default: 3x the longest run finished so far in its grid)")
    parser.add_argument("--only", choices=SIDES, default=None, help="run one side's grid only (no ratio)")
    parser.add_argument("--quick", action="store_true", help=f"the tiny recipe, {QUICK_STEPS} steps, one lr per "
                        "side: its best in the last full comparison (else the recipe's)")
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eval-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seeds and (args.seed is not None or args.only or args.quick):
        parser.error("--seeds runs both sides of the full comparison once per seed: not with --seed, --only or "
                     "--quick")
    if args.trl_worker:
        return trl_worker(json.loads(Path(args.trl_worker).read_text()))
    if args.eval_worker:
        return eval_worker(json.loads(Path(args.eval_worker).read_text()))
    if not trl_available():
        print(f"python -m bench.vs_trl: {TRL_MISSING}", file=sys.stderr)
        return 2
    if args.quick:
        out = run(quick=True)
    else:
        from pipelinerl.config import load_config

        results = {}
        for recipe in [Path(r) for r in args.recipe] if args.recipe else default_recipes():
            recipe_lr = load_config(recipe, [*args.set, "run_dir=unused"]).trainer.lr
            lrs = {"pipelinerl": _floats(args.lrs_pipelinerl) or lr_grid(recipe_lr),
                   "trl": _floats(args.lrs_trl) or lr_grid(recipe_lr)}
            if args.only:
                lrs = {args.only: lrs[args.only]}
            common = {"lrs": lrs, "steps": args.steps, "eval_every": args.eval_every,
                      "trl_threads": args.trl_threads, "extra": args.set, "reuse": args.reuse,
                      "budget_s": args.run_budget_s, "pipelinerl_extra": args.set_pipelinerl}
            if args.seeds:
                result = compare_seeds(recipe, [int(s) for s in args.seeds.split(",") if s], args.target_fraction,
                                       **common)
            else:
                result = compare_workload(recipe, target_fraction=args.target_fraction, seed=args.seed, **common)
            results[result["workload"]] = result
        out = combine(results)
    for name, r in out["workloads"].items():
        print(f"\n{name}: {format_grid(r)}")
        print(f"{r['summary']}; target {r['target']:g}x: {'met' if r['passed'] else 'NOT met'}")
        print(f"json: {r['json']}; plot: {r['png']}")
    print(f"\nmachine: {out['machine']}")
    return 0


def format_grid(result: dict) -> str:
    """The grid as a Markdown table: each run's held-out accuracy at the start and end, time to the target, speed."""
    per_run = {(p["side"], p["lr"]): p for p in result.get("per_run_to_target") or []}
    lines = [f"target held-out accuracy {_fmt_acc(result['target_accuracy'])} (base {result['base_accuracy']:.3f})",
             "", "| side | lr | held-out start -> end | s to target | ms/step | samples/s |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for r in result["grid"]:
        p = per_run.get((r["side"], r["lr"]), {})
        t = p.get("seconds_to_target")
        held_out = f"{r['held_out'][0][1]:.3f} -> {r['held_out'][-1][1]:.3f}" if r["held_out"] else "-"
        lines.append(f"| {r['side']} | {r['lr']:g} | {held_out} | "
                     f"{'-' if t is None else f'{t:.0f}'} | {1000 * (r['seconds_per_step'] or 0):.0f} | "
                     f"{r['samples_per_s'] or 0:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
