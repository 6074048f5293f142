"""`pipelinerl plot RUN_DIR [RUN_DIR ...]`: PNG curves of a run's metrics (reward, the accuracy of all answers
generated, held-out accuracy, lag, throughput, KL, entropy), against step and against wall-clock time; several
runs overlay for comparison. Runs whose evaluation is per benchmark (`eval_<benchmark>_avg@<k>` keys) also get
eval_benchmarks.png: one line per benchmark and their mean, one panel per run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

# Each panel: (title, candidate metric keys, first found is drawn).
PANELS = [
    ("reward (trained batch)", ["reward_mean", "reward"]),
    # every answer the actor scored, kept or dropped by dynamic sampling (`generated_accuracy`)
    ("accuracy of all answers generated", ["generated_accuracy"]),
    ("held-out accuracy", ["eval_accuracy", "eval/accuracy"]),  # the mean over benchmarks where there are several
    ("lag (versions)", ["lag_mean", "lag"]),
    ("samples / s", ["samples_per_s"]),
    ("tokens / s", ["tokens_per_s"]),
    ("KL", ["kl"]),
    ("entropy", ["entropy"]),
    ("loss", ["loss"]),
]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    return _jsonl_rows(path)


def _jsonl_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written while we read
    return rows


def generated_accuracy(run_dir: str | Path, min_samples: int = 256) -> list[dict]:
    """The accuracy of every answer the actor scored, kept or dropped by dynamic sampling, as rows
    {"step", "time", "generated_accuracy"}: from the cumulative counters of `actor_metrics.jsonl`, over windows of
    at least `min_samples` answers (the actor reports every 5 s). "step" is the trainer's version the actor had
    seen at the window's end, "time" the actor's clock (both start with the run). Empty without the file or the
    counters (a run from before they existed)."""
    path = Path(run_dir) / "actor_metrics.jsonl"
    if not path.exists():
        return []
    out, start = [], None
    for row in _jsonl_rows(path):
        if "samples_generated" not in row:
            continue
        if start is None or row["samples_generated"] < start["samples_generated"]:
            start = row  # the first row, or a resumed actor whose counters began again at 0
            continue
        n = row["samples_generated"] - start["samples_generated"]
        if n >= min_samples:
            correct = row["samples_generated_correct"] - start["samples_generated_correct"]
            out.append({"step": row["trainer_version"], "time": row["time"], "generated_accuracy": correct / n})
            start = row
    return out


def _series(rows: list[dict], keys: list[str], x_key: str) -> tuple[list[float], list[float]]:
    for key in keys:
        pts = [(r[x_key], r[key]) for r in rows if key in r and x_key in r and _finite(r[key])]
        if pts:
            return [p[0] for p in pts], [p[1] for p in pts]
    return [], []


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def panels_with_data(runs: dict[str, list[dict]]) -> list[tuple[str, list[str]]]:
    """The panels of `PANELS` that some run has a metric for."""
    return [p for p in PANELS if any(_series(rows, p[1], "step")[0] for rows in runs.values())]


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write `<out>/curves_step.png` and `<out>/curves_time.png` (out defaults to the first run dir), and
    `<out>/eval_benchmarks.png` when a run evaluates per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) + generated_accuracy(d) for d in run_dirs}
    out_dir = Path(out or run_dirs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = panels_with_data(runs)
    if not panels:
        raise ValueError(f"no plottable metrics in {', '.join(runs)}")
    written = []
    for x_key, x_label, name in (("step", "step", "curves_step.png"), ("time", "wall-clock seconds",
                                                                       "curves_time.png")):
        if not any(_series(rows, ["step"], x_key)[0] for rows in runs.values()):
            continue
        cols = min(3, len(panels))
        rows_n = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.4 * rows_n), squeeze=False)
        for ax, (title, keys) in zip(axes.flat, panels):
            for label, rows in runs.items():
                xs, ys = _series(rows, keys, x_key)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=Path(label).name)
            ax.set_title(title)
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        if len(runs) > 1:
            axes.flat[0].legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    benchmarks = plot_benchmarks(runs, out_dir / "eval_benchmarks.png")
    if benchmarks is not None:
        written.append(benchmarks)
    domains = plot_domains(runs, out_dir / "domains.png")
    if domains is not None:
        written.append(domains)
    return written


_DOMAIN_KEY = re.compile(r"^domain_(?P<name>.+)_(?P<metric>accuracy|reward_mean|output_tokens_mean|truncated_frac|"
                         r"lag_mean)$")
DOMAIN_PANELS = (("accuracy", "trained accuracy"), ("reward_mean", "reward"), ("output_tokens_mean", "output tokens"),
                 ("truncated_frac", "truncated"), ("lag_mean", "lag (versions)"))


def plot_domains(runs: dict[str, list[dict]], out_png: str | Path) -> Path | None:
    """The training numbers of a run with several domains (`domain_<name>_*`), one line per domain, a row of
    panels per run: accuracy, reward, output length, truncation and lag, never blended. None (and no file) when
    no run has domains."""
    per_run = {}
    for label, rows in runs.items():
        names = list(dict.fromkeys(m["name"] for row in rows for key in row if (m := _DOMAIN_KEY.match(key))))
        if names:
            per_run[label] = names
    if not per_run:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_run), len(DOMAIN_PANELS), figsize=(4.2 * len(DOMAIN_PANELS), 3.4 * len(per_run)),
                             squeeze=False)
    for row_axes, (label, names) in zip(axes, per_run.items()):
        for ax, (metric, title) in zip(row_axes, DOMAIN_PANELS):
            for name in names:
                xs, ys = _series(runs[label], [f"domain_{name}_{metric}"], "step")
                if xs:
                    ax.plot(xs, ys, label=name)
            ax.set_title(f"{Path(label).name}: {title}" if len(runs) > 1 else f"{title} per domain")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize="small")
    return _save(fig, out_png)


_BENCHMARK_KEY = re.compile(r"^eval_(?P<name>.+)_avg@(?P<k>\d+)$")


def benchmark_keys(rows: list[dict]) -> dict[str, str]:
    """Benchmark name -> its metric key (`eval_<benchmark>_avg@<k>`), in order of first appearance."""
    found: dict[str, str] = {}
    for row in rows:
        for key in row:
            m = _BENCHMARK_KEY.match(key)
            if m and m["name"] not in found:
                found[m["name"]] = key
    return found


def plot_benchmarks(runs: dict[str, list[dict]], out_png: str | Path) -> Path | None:
    """One panel per run with a per-benchmark eval: avg@k of each benchmark against step, and the mean over
    benchmarks (`eval_accuracy`) dashed. None (and no file) when no run has per-benchmark keys."""
    per_run = {label: benchmark_keys(rows) for label, rows in runs.items()}
    per_run = {label: keys for label, keys in per_run.items() if keys}
    if not per_run:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_run), figsize=(6 * len(per_run), 4), squeeze=False)
    for ax, (label, keys) in zip(axes.flat, per_run.items()):
        rows = runs[label]
        for name, key in keys.items():
            xs, ys = _series(rows, [key], "step")
            ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, label=name)
        xs, ys = _series(rows, ["eval_accuracy"], "step")
        if xs:
            ax.plot(xs, ys, "k--", marker="o" if len(xs) < 40 else None, label="mean")
        k = next(iter(keys.values())).rsplit("@", 1)[-1]
        ax.set_title(f"{Path(label).name}: avg@{k} per benchmark" if len(runs) > 1 else f"avg@{k} per benchmark")
        ax.set_xlabel("step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, out_png)


def plot_comparison(run_dirs: dict[str, str | Path], out_png: str | Path) -> Path:
    """One PNG comparing runs: held-out accuracy and training reward against wall-clock time and samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: read_metrics(d) for label, d in run_dirs.items()}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for col, (x_key, x_label) in enumerate((("time", "wall-clock seconds"), ("samples_total", "samples trained on"))):
        for row, (title, keys) in enumerate((("held-out accuracy", ["eval_accuracy"]),
                                             ("training reward", ["reward_mean"]))):
            ax = axes[row][col]
            for label, rows in runs.items():
                xs, ys = _series(rows, keys, x_key)
                if xs:
                    ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, label=label)
            ax.set_title(f"{title} vs {x_label}")
            ax.set_xlabel(x_label)
            if row == 0:
                ax.set_ylabel("avg@k, mean over benchmarks")
            ax.grid(alpha=0.3)
            ax.legend()
    return _save(fig, out_png)


def _save(fig, out_png: str | Path) -> Path:
    """Write a figure as PNG (making its folder) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
