"""What the run shows of itself: progress from its metrics rows while it trains, the checkpoint a rerun resumes
from, and the report at the end."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm


def read_new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """The rows of the JSON lines file `path` past byte `offset`, and the offset after them. Only complete lines
    are read (one still being written is left for the next call); one that does not parse is skipped."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    rows = []
    for line in chunk[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows, offset + end


class Progress:
    """The run's progress from its metrics rows: a tqdm bar on a terminal; elsewhere (a log file, a batch job)
    a plain summary line every `every_s` seconds, and each held-out evaluation, instead of a bar redrawn with
    carriage returns."""

    def __init__(self, max_steps: int, every_s: float, resumed_at: int = 0, terminal: bool | None = None):
        self.max_steps, self.every_s, self.resumed_at = max_steps, every_s, resumed_at
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self.bar = tqdm(total=max_steps, initial=resumed_at, desc="steps", unit="step", mininterval=1.0,
                        dynamic_ncols=True, disable=not self.terminal)
        self.started = time.monotonic()
        self.last_line = -math.inf

    def show(self, row: dict) -> None:
        if "eval_accuracy" in row:
            self._print(f"step {row['step']}: held-out pass@1 {row['eval_accuracy']:.3f}")
            return
        if self.terminal:
            self.bar.n = row["step"]
            self.bar.set_postfix({"samples/s": f"{row['samples_per_s']:.1f}", "tok/s": f"{row['tokens_per_s']:.0f}",
                                  "reward": f"{row['reward_mean']:.3f}", "lag": f"{row.get('lag_mean', 0):.2f}"},
                                 refresh=False)
            self.bar.refresh()
        elif time.monotonic() - self.last_line >= self.every_s or row["step"] >= self.max_steps:
            self._print(self.summary(row))

    def summary(self, row: dict) -> str:
        """One line: step, share done, throughput, reward, lag, time so far and left."""
        step, elapsed = row["step"], time.monotonic() - self.started
        done_here = step - self.resumed_at
        eta = elapsed / done_here * (self.max_steps - step) if done_here > 0 else None
        return (f"step {step}/{self.max_steps} ({100 * step / self.max_steps:.0f}%) | "
                f"{row['samples_per_s']:.1f} samples/s | {row['tokens_per_s']:.0f} tok/s | "
                f"reward {row['reward_mean']:.3f} | lag {row.get('lag_mean', 0):.2f} | "
                f"elapsed {_duration(elapsed)}" + (f" | left ~{_duration(eta)}" if eta is not None else ""))

    def _print(self, line: str) -> None:
        if self.terminal:
            self.bar.write(line)
        else:
            print(line, flush=True)
            self.last_line = time.monotonic()

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def resumed_version(run_dir: Path) -> int:
    """The version of the newest complete checkpoint of the run, 0 if none: where a rerun's trainer resumes.
    (Read from the files, without importing the trainer.)"""
    best = 0
    for state in (run_dir / "checkpoints").glob("step_*/trainer_state.json"):
        try:
            best = max(best, int(json.loads(state.read_text())["version"]))
        except (OSError, ValueError, KeyError):
            continue
    return best


def report(run_dir: Path) -> None:
    """Held-out accuracy before and after, the accuracy of the answers generated, the curves as PNG, where
    everything is."""
    from pipelinerl.plot import generated_accuracy, plot_runs, read_metrics

    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval_accuracy" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        print(f"held-out pass@1: {first['eval_accuracy']:.3f} at step {first['step']} -> "
              f"{last['eval_accuracy']:.3f} at step {last['step']} "
              f"({100 * (last['eval_accuracy'] - first['eval_accuracy']):+.1f} points)")
    generated = generated_accuracy(run_dir)
    if len(generated) >= 2:  # the policy's own accuracy: the trained batch's reward leaves dynamic sampling's drops out
        print(f"answers generated: {generated[0]['generated_accuracy']:.3f} right in the first window -> "
              f"{generated[-1]['generated_accuracy']:.3f} in the last (actor_metrics.jsonl, all groups, kept or "
              "dropped)")
    try:
        pngs = plot_runs([run_dir])
        print(f"curves: {', '.join(str(p) for p in pngs)}")
    except ValueError as e:
        print(f"no curves: {e}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}; final model: {run_dir / 'final_model'}; logs: {run_dir / 'logs'}")
