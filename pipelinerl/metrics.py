"""Where the trainer's per-step metrics go: `RUN_DIR/metrics.jsonl` always; TensorBoard and Weights & Biases when
the config turns them on. One row is a dict with a `step`; every finite number in it becomes a scalar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipelinerl.config import MetricsConfig


def continue_metrics(run_dir: str | Path, version: int, name: str = "metrics.jsonl") -> int:
    """Make `RUN_DIR/<name>` (rows with a `step`) end where a run resumed at `version` continues: rows of later
    steps (written after the checkpoint it resumed from, and about to be redone) are removed, so every step
    appears once; a run starting from version 0 starts an empty file. Returns the number of rows removed.
    Atomic (a rename)."""
    path = Path(run_dir) / name
    if not path.exists():
        return 0
    kept, removed = [], 0
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            removed += 1  # a torn last line of a killed writer
            continue
        if version > 0 and step <= version:
            kept.append(line)
        else:
            removed += 1
    if removed:
        tmp = path.with_name(f".tmp-{name}")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return removed


class JsonlAppender:
    """One JSON object per line, appended and flushed row by row (a killed writer leaves at most a torn last
    line, which `continue_metrics` drops)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricsSink:
    """`resume_version`: the version a resumed run continues from; TensorBoard then drops its events of later
    steps (metrics.jsonl is trimmed by `continue_metrics`)."""

    def __init__(self, run_dir: str | Path, cfg: MetricsConfig, run_config: dict[str, Any] | None = None,
                 resume_version: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._tb = None
        self._wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(f"metrics.tensorboard: needs the tensorboard package ({e}); "
                                   "`pip install -e '.[tensorboard]'` or set metrics.tensorboard=false") from None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                     purge_step=resume_version + 1 if resume_version > 0 else 0)
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(f"metrics.wandb_project: needs the wandb package ({e}); "
                                   "`pip install -e '.[wandb]'` or leave metrics.wandb_project empty") from None
            # The run directory's name is the W&B run id, so a resumed run continues the same W&B run.
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(self.run_dir), mode=cfg.wandb_mode,
                                     id=self.run_dir.resolve().name, resume="allow", config=run_config or {})

    def write(self, row: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        scalars = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        step = int(row["step"])
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
