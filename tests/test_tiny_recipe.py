"""The tiny recipe at reduced size: the whole system (warm-up, engine, actor, rewards, trainer, in-flight updates)
learns: held-out accuracy after RL is higher than before, under a fixed seed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_recipe_learns(tmp_path):
    run_dir = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_cpu.yaml"),
           f"run_dir={run_dir}", "trainer.max_steps=150", "trainer.eval_every=150"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if "eval_accuracy" in e]
    assert [e["step"] for e in evals] == [0, 150]
    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    assert 0 < before < 0.5, "the warm-up should leave a low but non-zero success rate"
    assert after > before + 0.05, f"held-out pass@1 {before:.3f} -> {after:.3f}"
    assert "held-out pass@1" in r.stdout and (run_dir / "curves_time.png").exists()
