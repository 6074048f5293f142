"""Pipelined RL against synchronous RL (`actor.max_lag: 0`) on the tiny recipe, same cores, same split.

Two benchmarks share this module:
- `pipeline_throughput` (issue: the pipeline): samples/s of the pipelined run against the synchronous one, over
  the training period of each run. The bound for the split is (T_gen + T_train) / max(T_gen, T_train), with
  T_gen the synchronous run's mean wait for a batch and T_train its mean optimizer step plus weight broadcast,
  over the same steps as the samples/s. Target: the ratio reaches 90% of the bound.
- `tiny_sync_vs_pipelined` (issue: the tiny recipe): both runs of the full recipe with held-out evaluation;
  one PNG of both curves against wall-clock time and against samples; the pipelined run must reach the
  synchronous run's final held-out accuracy in less wall-clock time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean

from bench.common import RESULTS_DIR, machine, median, subprocess_env, verdict

NAME = "pipeline_throughput"
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"


def launch(run_dir: Path, overrides: list[str], timeout_s: int = 1800, recipe: Path = RECIPE) -> list[dict]:
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(recipe), f"run_dir={run_dir}", *overrides]
    env = subprocess_env()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"run in {run_dir} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(rows: list[dict], skip: int) -> list[dict]:
    """The training steps' rows from step `skip` on (held-out evaluations' rows left out)."""
    return [r for r in rows if "samples_per_s" in r][skip:]


def step_times(rows: list[dict], average: Callable[[list[float]], float] = mean) -> tuple[float, float]:
    """The average wait for a batch and the average trainer step with its weight broadcast, in seconds."""
    return (average([r["wait_for_samples_s"] for r in rows]),
            average([r["step_s"] + r["broadcast_s"] for r in rows]))


def throughput(rows: list[dict], skip: int) -> float:
    """Samples/s between the end of step `skip` and the last step (start-up and first batches excluded)."""
    train = step_rows(rows, skip)
    first, last = train[0], train[-1]
    return (last["samples_total"] - first["samples_total"]) / (last["time"] - first["time"])


def measure_throughput(recipe: Path, steps: int, skip: int, model_path: Path, timeout_s: int = 1800,
                       extra: Sequence[str] = ()) -> dict:
    """Pipelined (max_lag 2) then synchronous (max_lag 0) runs of `recipe` from the base model at `model_path`
    (built and warmed up by the first run, then reused, so warm-up is part of neither measurement); returns the
    result dict of the benchmark."""
    common = [f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
              f"model.path={model_path}", *extra]
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-") as tmp:
        base = Path(tmp)
        pipelined = launch(base / "pipelined", common + ["actor.max_lag=2"], timeout_s, recipe)
        sync = launch(base / "sync", common + ["actor.max_lag=0"], timeout_s, recipe)
    return {**summarize(pipelined, sync, skip),
            "settings": {"recipe": str(recipe.relative_to(ROOT)), "steps": steps, "skipped_steps": skip,
                         "overrides": list(extra), "pipelined": "actor.max_lag=2", "sync": "actor.max_lag=0"},
            "machine": machine()}


def summarize(pipelined: list[dict], sync: list[dict], skip: int) -> dict:
    """The benchmark's figures from the metrics rows of the pipelined and the synchronous run, from step `skip` on:
    samples/s of each, their ratio, the bound for the split and what each run's steps spent."""
    # Synchronous: a step waits for its whole batch to be generated, then trains, so the two are T_gen and
    # T_train. Means, not medians, over the steps the samples/s spans: samples/s is total samples over total time,
    # and a step's length varies a lot where samples without advantage skip the trainer (0.4 to 8 s on
    # counting_cpu), so medians would put the bound where the throughput cannot follow.
    sync_steps, pipe_steps = step_rows(sync, skip)[1:], step_rows(pipelined, skip)[1:]
    if not sync_steps or not pipe_steps:
        raise ValueError(f"no steps to measure: each run needs at least {skip + 2} steps (skip={skip})")
    t_gen, t_train = step_times(sync_steps)
    bound = (t_gen + t_train) / max(t_gen, t_train)
    # where a pipelined step's time goes: the trainer's own step (slower than T_train where generation beside it
    # takes memory bandwidth or CPU from it, or where its batches had fewer samples left out) and its wait for a
    # batch (generation not hidden)
    pipe_wait, pipe_train = step_times(pipe_steps)
    pipelined_steps = {"t_train_s": pipe_train, "wait_for_samples_s": pipe_wait}
    medians = {name: dict(zip(("t_gen_s", "t_train_s"), step_times(steps, median)))
               for name, steps in (("sync", sync_steps), ("pipelined", pipe_steps))}
    # What the trainer did per step in each run: where samples without advantage skip it, the two runs' batches
    # differ in work by chance, so the trainer's step compares across runs per sample it trained on (how much
    # generation beside it slows it down)
    trained = {name: mean([r["samples"] - r.get("samples_left_out", 0.0) for r in steps])
               for name, steps in (("sync", sync_steps), ("pipelined", pipe_steps))}
    per_trained = {"sync": t_train / max(trained["sync"], 1e-9),
                   "pipelined": pipe_train / max(trained["pipelined"], 1e-9)}
    sps_pipe, sps_sync = throughput(pipelined, skip), throughput(sync, skip)
    ratio = sps_pipe / sps_sync
    return {
        "ratio": ratio,
        "target": 0.9 * bound,
        **verdict(ratio, 0.9 * bound),
        "summary": f"{sps_pipe:.3g} vs {sps_sync:.3g} samples/s; bound {bound:.2f} "
                   f"(T_gen {1000 * t_gen:.0f} ms, T_train {1000 * t_train:.0f} ms)",
        "samples_per_s": {"pipelined": sps_pipe, "sync": sps_sync},
        "bound": bound, "t_gen_s": t_gen, "t_train_s": t_train,
        "fraction_of_bound": ratio / bound, "pipelined_means": pipelined_steps, "medians": medians,
        "samples_trained_per_step": trained, "trainer_s_per_trained_sample": per_trained,
    }


def run(quick: bool = False) -> dict:
    steps, skip = (40, 5) if quick else (150, 10)
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-model-") as tmp:
        # the tiny recipe's warm-up takes seconds: a fresh base model each time
        return measure_throughput(RECIPE, steps, skip, Path(tmp) / "base_model")


def compare(out_dir: Path = RESULTS_DIR, extra: list[str] = ()) -> dict:
    """The full recipe both ways, with held-out evaluation; writes tiny_sync_vs_pipelined.png."""
    from pipelinerl.plot import plot_comparison

    out_dir.mkdir(parents=True, exist_ok=True)
    runs_root = ROOT / "runs" / "compare"
    model = [f"model.path={runs_root / 'base_model'}", *extra]
    rows = {"pipelined (max_lag 2)": launch(runs_root / "pipelined", model + ["actor.max_lag=2"]),
            "synchronous (max_lag 0)": launch(runs_root / "sync", model + ["actor.max_lag=0"])}
    png = plot_comparison({"pipelined (max_lag 2)": runs_root / "pipelined",
                           "synchronous (max_lag 0)": runs_root / "sync"}, out_dir / "tiny_sync_vs_pipelined.png")
    evals = {k: [r for r in v if "eval_accuracy" in r] for k, v in rows.items()}
    target = evals["synchronous (max_lag 0)"][-1]["eval_accuracy"]

    def time_to(label: str) -> float | None:
        hit = [r["time"] for r in evals[label] if r["eval_accuracy"] >= target - 1e-9]
        return hit[0] if hit else None

    result = {
        "final_accuracy": {k: v[-1]["eval_accuracy"] for k, v in evals.items()},
        "initial_accuracy": {k: v[0]["eval_accuracy"] for k, v in evals.items()},
        "target_accuracy": target,
        "seconds_to_target": {k: time_to(k) for k in evals},
        "total_seconds": {k: v[-1]["time"] for k, v in rows.items()},
        "png": str(png),
        "machine": machine(),
    }
    (out_dir / "tiny_sync_vs_pipelined.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if "--compare" in sys.argv:
        print(json.dumps(compare(), indent=2))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
