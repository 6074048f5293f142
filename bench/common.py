"""Helpers shared by the benchmarks: machine facts, interleaved timing, tiny models, result files, the table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parents[1]


def subprocess_env(threads: int | None = None) -> dict[str, str]:
    """The environment for a benchmark's child `pipelinerl`/`python -m bench...` process: this one's, with the
    checkout importable, and with `threads` pinning its OpenMP/MKL threads where given."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def cached_base_model(recipe: Path) -> Path:
    """Where benchmarks keep the base model of `recipe` (runs/bench/<recipe name>/base_model): the launcher builds
    and warms it up on first use and reuses it while its settings match (its marker file), so a warm-up that takes
    many minutes on 2 cores runs once per machine, not once per benchmark."""
    return ROOT / "runs" / "bench" / Path(recipe).stem / "base_model"


def machine() -> dict:
    """What the numbers depend on: library versions, cores, CPU model, and how busy the machine was (the load
    average counts other processes' runnable threads too)."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    family = None  # a VM may name only the vendor ("AMD EPYC"); the family and model say which generation
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = info.get("model name", cpu)
        if "cpu family" in info:
            family = f"family {info['cpu family']}, model {info.get('model', '?')}"
    except OSError:
        pass
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(), "cpu": cpu,
            "cpu_family": family,
            "cuda": torch.cuda.is_available(),
            "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


def interleaved(runs: dict[str, Callable[[], object]], repeats: int,
                warmup: int = 1) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Call each run `warmup` times, then `repeats` rounds of each in turn, so that drift in the machine's
    speed (other processes, clock changes) hits every run alike. Returns ({name: wall seconds},
    {name: CPU seconds of this process}) per call; CPU time is steadier than wall time on a shared machine."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def verdict(ratio: float, target: float) -> dict:
    return {"ratio": round(ratio, 3), "target": target, "passed": bool(ratio >= target)}


def tiny_model(root: str | Path, hidden_size: int, num_layers: int, seed: int = 0) -> Path:
    """A random tiny Qwen2 model saved under `root` (nothing downloaded). Heads of 32 or 64 dims."""
    from pipelinerl.models.tiny import build_tiny_model

    num_heads = max(4, hidden_size // 64)
    path = Path(root) / f"qwen2-h{hidden_size}-l{num_layers}"
    if not (path / "config.json").exists():
        build_tiny_model(path, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=2, seed=seed)
    return path


def model_settings(path: Path) -> dict:
    """Size facts of a saved model for the result file."""
    cfg = json.loads((path / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size")
    return {k: cfg[k] for k in keys}


def write_result(name: str, result: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """A plain text table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), line]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def run_comparison(parser: argparse.ArgumentParser, only: str, available: list[str],
                   compare: Callable[[list[str]], dict], table: Callable[[dict], str]) -> int:
    """The end of a comparison benchmark's command line: the runs `--only` names (comma-separated; every one when
    empty; unknown names refused through `parser`), compared, then their Markdown table, machine and plot."""
    names = [n for n in only.split(",") if n] or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"unknown name(s) {unknown}; available: {list(available)}")
    out = compare(names)
    print()
    print(table(out["results"]))
    print(f"\nmachine: {out['machine']}\nplot: {out['png']}")
    return 0
