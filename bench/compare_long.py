"""The race on long-tailed answers: synchronous, one-step off-policy and pipelined RL to the same held-out accuracy
(`make compare-long`, or `python -m bench.compare_long [--recipe R] [--seeds 0,1,2] [--steps N] [--arms ...]`).

Issue 51. AReaL and PipelineRL measure their 2-2.8x on reasoning workloads whose answer lengths span from a few
hundred to many thousand tokens: a synchronous step waits for its longest answer while most of the batch is done.
`recipes/counting_long_cpu.yaml` is such a workload on CPU (answers of 20 to 490 tokens, the median 70, a 24M
model). Every arm runs from the same warmed-up base model (built once, cached in runs/bench/<recipe>/base_model),
with the same data, held-out set, batch and seeds; only the schedule differs:

- `sync`: synchronous RL made as strong as synchrony honestly is: `actor.max_lag=0`, the whole batch in flight at
  once on the same engine (the recipe's `actor.concurrency` is the batch), nothing between the phases but the
  weight broadcast;
- `one_step`: one-step off-policy (verl's and TRL's asynchronous mode: `actor.one_step_off_policy`): batch k+1
  generated, whole, by the weights before batch k's update while the trainer trains on batch k;
- `pipelined`: this project's in-flight weight updates at `actor.max_lag` = `--max-lag` (groups start as places
  free up; the engine switches weights between two decoding steps).

Per arm, over its seeds: samples/s over the training period, the generated answers' lengths, and the held-out
curve on the trainer's clock (held-out evaluations' own time left out; every arm evaluates at the same steps).
Targets are 50 / 75 / 90% of the way from the base model's accuracy to the synchronous arm's final one (means
over seeds); each arm's time to each, on its mean curve (accuracy and clock averaged per evaluation step), and
the synchronous time over it, with each seed's own time beside it (the synchronous arm reaches its own mean's
targets by construction, the others must beat its noise: read the ratios with the spread); and each arm's accuracy
at the time the fastest arm finished, its last evaluation included (equal wall-clock).
Writes bench/results/compare_long.{json,png}; prints the table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.common import RESULTS_DIR, cached_base_model, machine
from bench.pipeline_vs_sync import ROOT, launch, throughput
from bench.vs_trl import pipelinerl_curves, prepare_base_model, time_to_accuracy

RECIPE = ROOT / "recipes" / "counting_long_cpu.yaml"
ARMS = ("sync", "one_step", "pipelined")
TARGETS = (0.5, 0.75, 0.9)


def arm_overrides(arm: str, max_lag: int) -> list[str]:
    if arm == "sync":
        return ["actor.max_lag=0", "actor.one_step_off_policy=false"]
    if arm == "one_step":
        return ["actor.max_lag=1", "actor.one_step_off_policy=true"]
    if arm == "pipelined":
        return [f"actor.max_lag={max_lag}", "actor.one_step_off_policy=false"]
    raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")


def answer_lengths(run_dir: Path) -> list[int]:
    """The output tokens of every sample the run streamed to its trainer."""
    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import open_reader

    return [len(r["output_token_ids"]) for r in open_reader(StreamsConfig(), run_dir, "samples").read()]


def length_summary(lengths: Sequence[int]) -> dict:
    xs = sorted(lengths)
    if not xs:
        return {}
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"n": len(xs), "min": xs[0], "median": at(0.5), "p90": at(0.9), "max": xs[-1],
            "mean": statistics.mean(xs), "max_over_min": xs[-1] / max(1, xs[0])}


def mean_curve(runs: Sequence[dict]) -> list[tuple[float, float]]:
    """(seconds, accuracy) per evaluation step, both averaged over the runs that reached that step."""
    by_step: dict[int, list[dict]] = {}
    for run in runs:
        for e in run["evals"]:
            by_step.setdefault(e["step"], []).append(e)
    return [(statistics.mean(e["train_s"] for e in es), statistics.mean(e["accuracy"] for e in es))
            for step, es in sorted(by_step.items()) if len(es) == len(runs)]


def accuracy_at(curve: Sequence[tuple[float, float]], t: float) -> float | None:
    """The accuracy of the last evaluation at or before `t` on a (seconds, accuracy) curve."""
    reached = [acc for s, acc in curve if s <= t + 1e-9]
    return reached[-1] if reached else None


def analyse(runs: dict[str, list[dict]]) -> dict:
    """The race's figures from each arm's runs ({"evals": [{"step", "accuracy", "train_s"}], "samples_per_s",
    "end_s"}): see the module docstring."""
    curves = {arm: mean_curve(rs) for arm, rs in runs.items() if rs}
    out: dict = {"arms": {}}
    if "sync" not in curves or len(curves["sync"]) < 2:
        return {**out, "why": "the synchronous arm has no curve to set the targets"}
    base = curves["sync"][0][1]
    final = curves["sync"][-1][1]
    out.update(base_accuracy=base, sync_final_accuracy=final)
    targets = {f"{int(f * 100)}%": base + f * (final - base) for f in TARGETS} if final > base else {}
    if not targets:
        out["why"] = f"the synchronous arm did not learn ({base:.3f} -> {final:.3f}): no target to race to"
    equal_t = min(statistics.mean(r["end_s"] for r in rs) for rs in runs.values() if rs)
    out["equal_wall_clock_s"] = equal_t
    sync_times = {name: time_to_accuracy(curves["sync"], acc) for name, acc in targets.items()}
    for arm, rs in runs.items():
        if not rs:
            continue
        times = {name: time_to_accuracy(curves[arm], acc) for name, acc in targets.items()}
        # each seed on its own too: the mean curve's time hides the spread (and the targets come from the
        # synchronous arm's own mean, which that arm reaches by construction)
        per_seed = {name: [time_to_accuracy([(e["train_s"], e["accuracy"]) for e in r["evals"]], acc) for r in rs]
                    for name, acc in targets.items()}
        speedup = {name: (sync_times[name] / t if t and sync_times[name] is not None else None)
                   for name, t in times.items()}
        finals = [r["evals"][-1]["accuracy"] for r in rs]
        out["arms"][arm] = {
            "seeds": len(rs),
            "samples_per_s": statistics.mean(r["samples_per_s"] for r in rs),
            "samples_per_s_spread": [min(r["samples_per_s"] for r in rs), max(r["samples_per_s"] for r in rs)],
            "final_accuracy": statistics.mean(finals),
            "final_accuracy_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "seconds": statistics.mean(r["end_s"] for r in rs),
            "seconds_to_target": times, "speedup_over_sync": speedup, "seconds_to_target_per_seed": per_seed,
            "accuracy_at_equal_wall_clock": accuracy_at(curves[arm], equal_t),
            "curve": curves[arm],
        }
    out["targets"] = targets
    return out


def summarise_run(rows: list[dict], run_dir: Path, skip: int) -> dict:
    curves = pipelinerl_curves(rows)
    steps = curves["steps"]
    # the run ends with its last evaluation, written after the last step's row
    end_s = max([s["train_s"] for s in steps[-1:]] + [e["train_s"] for e in curves["evals"][-1:]], default=0.0)
    return {"evals": curves["evals"], "samples_per_s": throughput(rows, skip),
            "end_s": end_s, "lengths": length_summary(answer_lengths(run_dir)),
            "lag_max": max((r.get("lag_max", 0) for r in rows if "samples_per_s" in r), default=0)}


def finished_rows(run_dir: Path, overrides: list[str]) -> list[dict] | None:
    """The metrics rows of a run in `run_dir` that finished with these overrides (read back, not run again)."""
    marker, metrics = run_dir / "race_overrides.json", run_dir / "metrics.jsonl"
    if not (marker.exists() and metrics.exists()) or json.loads(marker.read_text()) != overrides:
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def race(recipe: Path, arms: Sequence[str], seeds: Sequence[int], steps: int | None, eval_every: int | None,
         max_lag: int, root: Path, extra: Sequence[str] = ()) -> dict:
    base = prepare_base_model(recipe, cached_base_model(recipe), extra)
    common = [f"model.path={base}", "trainer.save_every=0", "trainer.save_every_minutes=0", *extra]
    if steps:
        common.append(f"trainer.max_steps={steps}")
    if eval_every:
        common.append(f"trainer.eval_every={eval_every}")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:  # seed by seed, every arm: a shortened race still compares arms on one seed set
        for arm in arms:
            run_dir = root / arm / f"seed{seed}"
            overrides = [*common, *arm_overrides(arm, max_lag), f"seed={seed}"]
            rows = finished_rows(run_dir, overrides)
            if rows is None:  # not run yet, or cut short (which a rerun would resume): run it afresh
                shutil.rmtree(run_dir, ignore_errors=True)
                rows = launch(run_dir, overrides, timeout_s=7200, recipe=recipe)
                (run_dir / "race_overrides.json").write_text(json.dumps(overrides))
            result = {"seed": seed, **summarise_run(rows, run_dir, skip=2)}
            runs[arm].append(result)
            curve = " -> ".join(format(e["accuracy"], ".3f") for e in result["evals"])
            print(f"{arm} seed {seed}: {result['samples_per_s']:.2f} samples/s, held-out {curve} in "
                  f"{result['end_s']:.0f} s", flush=True)
    return {"recipe": str(recipe.relative_to(ROOT)), "seeds": list(seeds), "max_lag": max_lag,
            "overrides": list(extra), "runs": runs, "analysis": analyse(runs), "machine": machine()}


def table(result: dict) -> str:
    a = result["analysis"]
    names = list(a.get("targets", {}))
    head = ["arm", "samples/s (range)", "final held-out (sd)", *[f"s to {n} (x sync)" for n in names],
            f"held-out at {a.get('equal_wall_clock_s', 0):.0f} s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for arm, r in a["arms"].items():
        cells = [f"{arm} ({r['seeds']} seeds)", f"{r['samples_per_s']:.2f} ({r['samples_per_s_spread'][0]:.2f}-"
                 f"{r['samples_per_s_spread'][1]:.2f})", f"{r['final_accuracy']:.3f} ({r['final_accuracy_sd']:.3f})"]
        for n in names:
            t, x = r["seconds_to_target"][n], r["speedup_over_sync"][n]
            cells.append("not reached" if t is None else f"{t:.0f} ({x:.2f}x)" if x else f"{t:.0f}")
        eq = r["accuracy_at_equal_wall_clock"]
        cells.append("-" if eq is None else f"{eq:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    lengths = [run["lengths"] for runs in result["runs"].values() for run in runs if run.get("lengths")]
    if lengths:
        lines.append("")
        lines.append("answer lengths (tokens, all runs): min {min} / median {median} / p90 {p90} / max {max}".format(
            min=min(x["min"] for x in lengths), median=statistics.median(x["median"] for x in lengths),
            p90=statistics.median(x["p90"] for x in lengths), max=max(x["max"] for x in lengths)))
    if a.get("why"):
        lines.append(f"\n{a['why']}")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, runs in result["runs"].items():
        for run in runs:
            ax.plot([e["train_s"] for e in run["evals"]], [e["accuracy"] for e in run["evals"]], alpha=0.25,
                    color=f"C{ARMS.index(arm)}")
        curve = result["analysis"]["arms"].get(arm, {}).get("curve", [])
        ax.plot([t for t, _ in curve], [acc for _, acc in curve], marker="o", color=f"C{ARMS.index(arm)}",
                label=f"{arm} (mean of {len(runs)})")
    for name, acc in result["analysis"].get("targets", {}).items():
        ax.axhline(acc, color="grey", lw=0.5, ls=":")
        ax.text(0, acc, f" {name}", va="bottom", fontsize=7, color="grey")
    ax.set_xlabel("seconds on the trainer's clock (held-out evaluations left out)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{result['recipe']}: synchronous vs one-step off-policy vs pipelined")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_long", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {','.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=None, help="trainer.eval_every (default: the recipe's)")
    parser.add_argument("--max-lag", type=int, default=2, help="the pipelined arm's actor.max_lag")
    parser.add_argument("--set", action="append", default=[], help="a recipe override for every arm (repeatable)")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "compare_long")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "sync" not in arms:
        parser.error(f"--arms: {unknown or 'sync is needed'} (the targets are the synchronous arm's); "
                     f"available: {','.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    result = race(args.recipe, arms, seeds, args.steps, args.eval_every, args.max_lag, args.root, args.set)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for arm_runs in result["analysis"]["arms"].values():
        arm_runs["curve"] = [list(p) for p in arm_runs["curve"]]
    (RESULTS_DIR / "compare_long.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS_DIR / "compare_long.png")
    print(table(result))
    print(f"\nbench/results/compare_long.json, .png; {result['machine'].get('cpu', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
