"""Where a step's time goes when compute costs next to nothing: `make step-cost` (`python -m bench.step_cost
[--steps N] [--skip N] [--lags 2,0] [--hidden H] [--layers L]`).

The pipeline's own machinery (HTTP round trips to the engine, the reward pool's IPC, stream writes and reads, the
actor's scheduling, the trainer's bookkeeping, the weight broadcast) costs about the same per step whatever the
model; on a small model it is most of a step (issue 51: on a sub-million-parameter task a step cost 55-100 ms, about
what TRL's whole in-process step costs). This runs `recipes/tiny_cpu.yaml` (64 samples a step, groups of 8, 6-token
answers) with a model so small that its forward and backward take a few milliseconds (hidden 16, one layer, no
warm-up; dynamic sampling off, so that every group counts whatever it scores; no held-out evaluation, no
checkpoints), pipelined (the recipe's max_lag 2) and synchronous (max_lag 0), and prints, per step, the median and
mean milliseconds of each stage on the trainer's clock:

- `interval`: from one step's metrics row to the next, everything included;
- `waiting for samples`: the trainer blocked on the sample stream (synchronous: the whole batch's generation);
- `checkpoint decision`: whether to save (agreed by the trainer processes), and a periodic save;
- `trainer step`, split into batching and the no-gradient passes, the policy's forward, backward and update, the
  critic, and the rest (statistics, the learning-rate and KL schedules);
- `publish`: the weight broadcast and the rest of it (engines checked, the version announced);
- `after the row`: writing the metrics row and the audit line, the barrier;
- `unaccounted`: the interval less the stages above.

And beside the trainer's clock, what the actor and the engine spent per step (they overlap the trainer when
pipelined, and each other): the engine's round trip per group as the actor sees it and the reward pool's per group
(`group_generate_s_mean`, `group_reward_s_mean` of the batch; the latter with the answers' detokenisation), and the
engine's decode seconds, decode steps and weight-update seconds per trainer step (its /metrics at the end of the
run, divided by the steps: start-up and, pipelined, the look-ahead generated past the last step included).

Writes bench/results/step_cost.json and prints the tables (docs/benchmarks.md keeps the current one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import RESULTS_DIR, machine
from bench.pipeline_vs_sync import ROOT, launch

RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"

# (name, how it is read from a metrics row); the trainer step's parts and the publish's, then the rest of a step
STAGES: tuple[tuple[str, str], ...] = (
    ("waiting for samples", "waiting_s"),
    ("checkpoint decision (and a save)", "checkpoint_s"),
    ("trainer step: batching, no-gradient passes", "step_prepare_s"),
    ("trainer step: policy forward, backward, update", "step_policy_s"),
    ("trainer step: critic", "step_critic_s"),
    ("trainer step: statistics, schedules", "step_rest_s"),
    ("publish: weight broadcast", "broadcast_s"),
    ("publish: engines checked, version announced", "publish_rest_s"),
    ("after the row: metrics, audit, barrier (an export, an evaluation)", "after_last_row_s"),
    ("unaccounted", "unaccounted_s"),
)


def stage_rows(rows: list[dict], skip: int) -> list[dict]:
    """Per training step from `skip` on: its interval and the seconds of each stage of STAGES. A step's
    `after_last_row_s` is what the step before it did after its row, so it is paired with that step's interval."""
    steps = [r for r in rows if "samples_per_s" in r]
    out = []
    for prev, row in zip(steps, steps[1:]):
        checkpoint = row.get("checkpoint_s", 0.0)  # after the last step's barrier, inside this step's wait
        stage = {"interval_s": row["time"] - prev["time"], "waiting_s": row["wait_for_samples_s"] - checkpoint,
                 "checkpoint_s": checkpoint,
                 "step_prepare_s": row.get("step_prepare_s", 0.0), "step_policy_s": row.get("step_policy_s", 0.0),
                 "step_critic_s": row.get("step_critic_s", 0.0), "broadcast_s": row["broadcast_s"],
                 "after_last_row_s": row.get("after_last_row_s", 0.0)}
        stage["step_rest_s"] = row["step_s"] - stage["step_prepare_s"] - stage["step_policy_s"] - stage["step_critic_s"]
        stage["publish_rest_s"] = row.get("publish_s", row["broadcast_s"]) - row["broadcast_s"]
        stage["unaccounted_s"] = stage["interval_s"] - sum(stage[key] for _, key in STAGES if key != "unaccounted_s")
        for key in ("group_generate_s_mean", "group_reward_s_mean"):
            if key in row:
                stage[key] = row[key]
        out.append(stage)
    return out[skip:]


def summarise(rows: list[dict], engine: dict, skip: int) -> dict:
    stages = stage_rows(rows, skip)
    if not stages:
        raise ValueError(f"no steps to measure after skipping {skip}")
    keys = ["interval_s", *(key for _, key in STAGES), "group_generate_s_mean", "group_reward_s_mean"]
    out = {key: {"median_ms": 1e3 * statistics.median(s[key] for s in stages if key in s),
                 "mean_ms": 1e3 * statistics.fmean(s[key] for s in stages if key in s)}
           for key in keys if any(key in s for s in stages)}
    steps = [r for r in rows if "samples_per_s" in r]
    per_step = {}
    if engine and steps:  # the engine's counters over the whole run, per trainer step
        n = len(steps)
        per_step = {
            "engine_decode_ms": 1e3 * engine.get("pipelinerl_decode_seconds_total", 0.0) / n,
            "engine_decode_steps": engine.get("pipelinerl_decode_steps_total", 0.0) / n,
            "engine_admissions": engine.get("pipelinerl_admissions_total", 0.0) / n,
            "engine_update_ms": 1e3 * (engine.get("pipelinerl_weight_update_receive_seconds_total", 0.0)
                                       + engine.get("pipelinerl_weight_update_switch_seconds_total", 0.0)) / n,
        }
    wall = steps[-1]["time"] - steps[skip]["time"] if len(steps) > skip + 1 else float("nan")
    return {"stages": out, "engine_per_step": per_step, "steps_measured": len(stages),
            "samples_per_s": sum(r["samples"] for r in steps[skip + 1:]) / wall}


def measure(lag: int, steps: int, skip: int, hidden: int, layers: int, root: Path) -> dict:
    run_dir = root / f"lag{lag}"
    overrides = [f"model.path={root / 'base_model'}", f"model.tiny_hidden_size={hidden}",
                 f"model.tiny_layers={layers}", "model.warmup_steps=0", f"trainer.max_steps={steps}",
                 "trainer.eval_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0",
                 "actor.dynamic_sampling=false", f"actor.max_lag={lag}"]
    rows = launch(run_dir, overrides, recipe=RECIPE)
    engine_file = run_dir / "engine0_metrics.json"
    engine = json.loads(engine_file.read_text()) if engine_file.exists() else {}
    return summarise(rows, engine, skip)


def table(results: dict[str, dict]) -> str:
    names = list(results)

    def stage_cells(key: str) -> list[str]:
        return [f"{s['median_ms']:.1f} ({s['mean_ms']:.1f})" if (s := results[n]["stages"].get(key)) else ""
                for n in names]

    lines = ["| stage | " + " | ".join(f"{n}: median ms (mean)" for n in names) + " |",
             "| --- | " + " | ".join("---" for _ in names) + " |"]
    beside = (("*beside the trainer*", ""), ("actor: engine round trip per group", "group_generate_s_mean"),
              ("actor: reward pool per group", "group_reward_s_mean"))
    for label, key in (("interval (the whole step)", "interval_s"), *STAGES, *beside):
        lines.append(f"| {label} | " + " | ".join(stage_cells(key) if key else ["" for _ in names]) + " |")
    for label, key, fmt in (("engine: decode ms per step", "engine_decode_ms", "{:.1f}"),
                            ("engine: decode steps per step", "engine_decode_steps", "{:.1f}"),
                            ("engine: weight update ms per step", "engine_update_ms", "{:.1f}")):
        cells = [fmt.format(results[n]["engine_per_step"][key]) if key in results[n]["engine_per_step"] else ""
                 for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| samples/s | " + " | ".join(f"{results[n]['samples_per_s']:.0f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20, help="first steps left out (start-up)")
    parser.add_argument("--lags", default="2,0", help="actor.max_lag of each run (default 2,0)")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args(argv)
    if args.steps < args.skip + 3:
        parser.error(f"--steps must be at least --skip + 3 = {args.skip + 3}")
    lags = [int(x) for x in args.lags.split(",") if x]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipelinerl-step-cost-") as tmp:
        for lag in lags:
            name = f"pipelined (max_lag {lag})" if lag else "synchronous (max_lag 0)"
            results[name] = measure(lag, args.steps, args.skip, args.hidden, args.layers, Path(tmp))
    out = {"results": results, "settings": {"recipe": str(RECIPE.relative_to(ROOT)), "steps": args.steps,
                                            "skip": args.skip, "hidden": args.hidden, "layers": args.layers},
           "machine": machine()}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "step_cost.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(results))
    print(f"\nmachine: {machine()}\nwrote {RESULTS_DIR / 'step_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
