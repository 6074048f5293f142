"""Start-up: seconds from `pipelinerl run` to the end of the first training step, on the heavier CPU workload
(recipes/counting_cpu.yaml's model, its warm-up skipped: the base model is built once and cached).

The launcher starts the trainer and the actor while the engine loads its model; they wait for the engine's URL.
Each launch is followed from outside, as a user sees it: when the engine listens (its port file), when the trainer
was set up and how long it then waited for the engine (its log), and when the first step's metrics row appears.

Ratio: without a baseline, the serial start (the engine's start, then the trainer's set-up, as the launcher did
before) over the measured time to the trainer being ready, the same launches. With `--baseline DIR` (a checkout of
another commit, e.g. `git worktree add /tmp/base eeb2009`), launches of both alternate and the ratio is the
baseline's time to the first step over this checkout's.

    python -m bench.startup [--rounds 5] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, median, subprocess_env, verdict, write_result

NAME = "startup"
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "counting_cpu.yaml"
WORK = ROOT / "runs" / "bench" / "startup"
TARGET = 1.0
SETUP = re.compile(r"set up in ([0-9.]+) s .* then waited ([0-9.]+) s for the engines")


def base_model() -> Path:
    """The recipe's model without its warm-up (start-up does not depend on the weights), built once."""
    from pipelinerl.config import load_config
    from pipelinerl.launch import prepare_model

    path = WORK / "base_model"
    return prepare_model(load_config(RECIPE, [f"run_dir={WORK}", f"model.path={path}", "model.warmup_steps=0"]))


def launch(repo: Path, run_dir: Path, model: Path, timeout_s: float = 600) -> dict:
    """One run of one step from `repo`'s code; the seconds from the command's start to each mark."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(repo / "recipes" / RECIPE.name), f"run_dir={run_dir}",
           f"model.path={model}", "model.warmup_steps=0", "trainer.max_steps=1", "trainer.eval_every=0",
           "trainer.save_every=0", "trainer.save_every_minutes=0"]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    marks: dict[str, float] = {}
    start = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=repo)
        while proc.poll() is None and "first_step_s" not in marks:
            now = time.monotonic() - start
            if "engine_listening_s" not in marks and (run_dir / "logs" / "engine0.port").exists():
                marks["engine_listening_s"] = now
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().endswith("\n"):
                marks["first_step_s"] = now
                marks["step_s"] = json.loads(metrics.read_text().splitlines()[0])["time"]
            assert now < timeout_s, f"no first step after {timeout_s} s: see {out.name}"
            time.sleep(0.02)
        code = proc.wait(timeout=timeout_s)
    if code != 0 or "first_step_s" not in marks:
        raise RuntimeError(f"run in {run_dir} failed (exit code {code}): see {run_dir.parent / run_dir.name}.log")
    found = SETUP.search((run_dir / "logs" / "trainer.log").read_text())
    if found:  # this checkout's trainer says when it was ready and how long it waited for the engines
        marks["trainer_setup_s"], marks["trainer_waited_s"] = float(found[1]), float(found[2])
    shutil.rmtree(run_dir, ignore_errors=True)
    return marks


def run(quick: bool = False, rounds: int | None = None, baseline: Path | None = None) -> dict:
    rounds = rounds or (2 if quick else 5)
    model = base_model()
    sides = {"this": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(rounds):  # alternating, so drift in the machine's load falls on both sides alike
        for side, repo in sides.items():
            marks = launch(repo, WORK / f"run-{side}", model)
            runs[side].append(marks)
            print(f"round {i + 1}/{rounds} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in marks.items()),
                  flush=True)
    medians = {side: {k: median([m[k] for m in rs if k in m]) for k in rs[0]} for side, rs in runs.items()}
    this = medians["this"]
    if baseline:
        ratio = medians["baseline"]["first_step_s"] / this["first_step_s"]
        summary = (f"first step {this['first_step_s']:.1f} s after the command, against {baseline.name}'s "
                   f"{medians['baseline']['first_step_s']:.1f} s")
    else:
        ready = this["first_step_s"] - this["step_s"]
        ratio = (this["engine_listening_s"] + this["trainer_setup_s"]) / ready
        summary = (f"trainer ready {ready:.1f} s after the command; engine listening at "
                   f"{this['engine_listening_s']:.1f} s, trainer set up in {this['trainer_setup_s']:.1f} s")
    return {"ratio": ratio, "target": TARGET, "passed": ratio >= TARGET, "summary": summary,
            "verdict": verdict(ratio, TARGET), "medians": medians, "runs": runs, "rounds": rounds,
            "baseline": str(baseline) if baseline else None, "machine": machine(),
            "command": "python -m bench.startup" + (f" --rounds {rounds}" if rounds != 5 else "")
                       + (f" --baseline {baseline}" if baseline else "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit to compare with")
    args = parser.parse_args(argv)
    result = run(rounds=args.rounds, baseline=args.baseline)
    path = write_result(NAME if not args.baseline else f"{NAME}_vs_baseline", result)
    print(json.dumps(result["medians"], indent=1))
    print(f"{result['summary']}; ratio {result['ratio']:.2f} (target {TARGET}); wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
