"""The metrics sink: JSONL always, TensorBoard and W&B (offline) when turned on."""

import json

import pytest

from pipelinerl.config import MetricsConfig
from pipelinerl.metrics import MetricsSink


def test_jsonl_and_tensorboard_get_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path, MetricsConfig(tensorboard=True))
    sink.write({"step": 1, "loss": 0.5, "note": "text is kept in JSONL only", "nan": float("nan")})
    sink.write({"step": 2, "loss": 0.25})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["note"].startswith("text")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert "nan" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra (`pip install -e '.[wandb]'`)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path / "run", MetricsConfig(wandb_project="pipelinerl-test", wandb_mode="offline"))
    sink.write({"step": 1, "loss": 0.5})
    sink.close()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
