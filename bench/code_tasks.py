"""The code recipes, measured: `make compare-tools` (or `python -m bench.code_tasks [--steps N] [--only NAME,...]`).

- "code": `recipes/tiny_code_cpu.yaml`, a tiny model learning to write one-line functions checked in the sandbox;
  its held-out pass@1 before and after RL is the issue's "+20 points within 15 minutes".
- "tool" against "no tool": `recipes/tiny_tool_cpu.yaml` with the interpreter (multi-turn) and the same recipe with
  `task.args.tool=false` (single-turn), same seed, same warm-up steps, same RL budget.

Each run starts from its own base model, built and warmed up by the run itself (the tool variant's warm-up text
holds the tool call, so the two cannot share one); warm-up time is not in the RL seconds reported. Writes
bench/results/code_tasks.json and bench/results/code_tasks.png (held-out accuracy and training reward against time
and samples) and prints a Markdown table for docs/code.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS_DIR, machine, run_comparison, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
RUNS: dict[str, tuple[str, list[str]]] = {  # name (no commas: --only splits on them) -> recipe, overrides
    "code": ("tiny_code_cpu.yaml", []),
    "tool": ("tiny_tool_cpu.yaml", []),  # multi-turn, with the interpreter
    # single-turn, the same task. Without dynamic sampling: the model can hardly multiply, so nearly every group is
    # all wrong and dynamic sampling would drop it; measured with it on, 7 RL steps took 12 minutes (59,123 groups
    # dropped), so the run would not finish. Off, it takes its 200 steps like the others.
    "no-tool": ("tiny_tool_cpu.yaml", ["task.args.tool=false", "actor.dynamic_sampling=false"]),
}


def launch(recipe: str, run_dir: Path, overrides: list[str], timeout_s: int = 3600) -> list[dict]:
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / recipe), f"run_dir={run_dir}",
           *overrides]
    env = subprocess_env()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"run in {run_dir} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict]) -> dict:
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "reward_mean" in r]
    first_eval_time = evals[0]["time"] if evals else 0.0
    return {"eval_accuracy": [(r["step"], round(r["eval_accuracy"], 4)) for r in evals],
            "eval_seconds_after_first": [round(r["time"] - first_eval_time, 1) for r in evals],
            "tool_calls_mean_last": steps[-1].get("tool_calls_mean") if steps else None,
            "train_seconds": steps[-1]["time"] if steps else None, "steps": len(steps)}


def table(results: dict[str, dict]) -> str:
    lines = ["| run | held-out pass@1 (at steps) | gain, points | RL seconds | tool calls per episode (last step) |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        accs = [acc for _, acc in r["eval_accuracy"]]
        gain = f"{100 * (accs[-1] - accs[0]):+.1f}" if len(accs) > 1 else ""
        calls = "" if r["tool_calls_mean_last"] is None else f"{r['tool_calls_mean_last']:.2f}"
        lines.append(f"| {name} | {' -> '.join(f'{a:.3f}' for a in accs)} "
                     f"({'/'.join(str(s) for s, _ in r['eval_accuracy'])}) | {gain} | {r['train_seconds']:.0f} | "
                     f"{calls} |")
    return "\n".join(lines)


def compare(steps: int | None, names: list[str], out_dir: Path = RESULTS_DIR) -> dict:
    from pipelinerl.plot import plot_comparison

    runs_root = ROOT / "runs" / "code_tasks"
    results, dirs = {}, {}
    for name in names:
        recipe, overrides = RUNS[name]
        run_dir = runs_root / name  # by name: `--only` must not resume another run's directory
        extra = [f"trainer.max_steps={steps}"] if steps else []
        print(f"== {name}: {recipe} {' '.join(overrides + extra)}", flush=True)
        t0 = time.perf_counter()
        rows = launch(recipe, run_dir, overrides + extra + ["trainer.save_every=0"])
        results[name] = {"recipe": recipe, "overrides": overrides + extra, **summarise(rows)}
        dirs[name] = run_dir
        print(f"   {time.perf_counter() - t0:.0f} s; held-out pass@1 {results[name]['eval_accuracy']}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_comparison(dirs, out_dir / "code_tasks.png")
    out = {"results": results, "png": str(png), "machine": machine()}
    (out_dir / "code_tasks.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.code_tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: each recipe's own)")
    parser.add_argument("--only", default="", help="comma-separated names, as listed in RUNS")
    args = parser.parse_args(argv)
    return run_comparison(parser, args.only, list(RUNS), lambda names: compare(args.steps, names), table)


if __name__ == "__main__":
    raise SystemExit(main())
