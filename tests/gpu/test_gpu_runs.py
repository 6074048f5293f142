"""Whole runs on GPUs (`pipelinerl run`, every process real): the tiny recipe on one GPU and with NCCL between GPUs,
and a trainer of two processes under DeepSpeed ZeRO-3 pushing its gathered weights into an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .conftest import gpu_count, needs_gpus, pipelinerl_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The tiny recipe, shortened: its warm-up, then STEPS steps with a held-out evaluation before, midway and after.
STEPS = 20
SHORT = [f"trainer.max_steps={STEPS}", "trainer.eval_every=10", "task.args.num_eval=100"]


def finished(result, run_dir: Path, steps: int) -> list[dict]:
    """Assert that the run ended well with every step trained and pushed; its metrics rows."""
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in rows if "eval_accuracy" not in r]
    assert [r["step"] for r in steps_done] == list(range(1, steps + 1))
    assert all(r["broadcast_bytes"] > 0 for r in steps_done)
    engine = json.loads((run_dir / "engine0_metrics.json").read_text())
    assert engine["pipelinerl_weight_version"] == steps
    assert (run_dir / "final_model" / "config.json").exists()
    return rows


def resolved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


@needs_gpus(1, "the tiny recipe on a GPU")
def test_tiny_recipe_on_one_gpu(tmp_path):
    """Trainer and engine share GPU 0 (`engine.colocate_with_trainer`); the weights go over gloo (NCCL cannot
    join two ranks on one GPU), and the recipe's explicit gloo is kept with a note; the dtype defaults to
    bfloat16 on a GPU."""
    run_dir = tmp_path / "run"
    result = pipelinerl_run("tiny_cpu.yaml", run_dir, *SHORT, "engine.colocate_with_trainer=true")
    rows = finished(result, run_dir, STEPS)
    assert "trainer on GPUs 0" in result.stdout and "engine0 on GPUs 0" in result.stdout, result.stdout
    assert "weight_sync.backend=gloo on a node with" in result.stdout
    cfg = resolved(run_dir)
    assert cfg["model"]["dtype"] == "bfloat16" and cfg["weight_sync"]["backend"] == "gloo"
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]


@needs_gpus(2, "the trainer on GPU 0 and the engine on GPU 1, NCCL between them")
def test_tiny_recipe_over_nccl_between_two_gpus(tmp_path):
    """With the backend left to the machine (auto), two GPUs give NCCL and bfloat16 on the wire."""
    run_dir = tmp_path / "run"
    result = pipelinerl_run("tiny_cpu.yaml", run_dir, *SHORT, "weight_sync.backend=auto")
    finished(result, run_dir, STEPS)
    assert "trainer on GPUs 0" in result.stdout and "engine0 on GPUs 1" in result.stdout, result.stdout
    cfg = resolved(run_dir)
    assert cfg["model"]["dtype"] == "bfloat16" and cfg["weight_sync"]["backend"] == "nccl"
    assert "joined weight-update group" in (run_dir / "logs" / "trainer.log").read_text()


@needs_gpus(2, "a trainer of two processes, one GPU each")
def test_zero3_trainer_on_two_gpus_pushes_to_an_engine(tmp_path):
    """DeepSpeed ZeRO-3 over GPUs 0 and 1 (`configs/accelerate/deepspeed_zero3.yaml`), the parameters gathered one
    bucket at a time and broadcast by rank 0: with a third GPU the engine has one of its own and NCCL carries
    the weights, with two it shares GPU 0 and gloo does."""
    run_dir = tmp_path / "run"
    steps = 5
    where = (["weight_sync.backend=auto"] if gpu_count() >= 3 else ["engine.colocate_with_trainer=true"])
    result = pipelinerl_run("tiny_cpu.yaml", run_dir, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                            "trainer.num_processes=2",
                            "trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml", *where)
    finished(result, run_dir, steps)
    assert "trainer on GPUs 0,1" in result.stdout, result.stdout
    # DeepSpeed wrote one ZeRO partition per rank into the final checkpoint (accelerate's save_state)
    shards = {p.name for p in (run_dir / "checkpoints").rglob("*zero_pp_rank_*")}
    assert any("zero_pp_rank_1_" in name for name in shards), f"no ZeRO partition of rank 1 saved: {shards}"
    assert resolved(run_dir)["weight_sync"]["backend"] == ("nccl" if gpu_count() >= 3 else "gloo")
