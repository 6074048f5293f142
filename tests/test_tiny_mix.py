"""recipes/tiny_mix_cpu.yaml shortened: three domains (arithmetic, a Reasoning Gym generator, IFEval constraints)
trained in one run, each domain's training numbers, sampling settings, held-out benchmark and IFEval levels
reported apart, and the per-domain plot written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("add", "backward", "constraints")


@pytest.mark.slow
def test_a_three_domain_run_reports_every_domain_apart(tmp_path):
    run_dir = tmp_path / "mix"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_mix_cpu.yaml"),
           # a short warm-up leaves most groups all wrong: without dynamic sampling they are trained on (with zero
           # advantage) instead of stopping the actor; this run checks what is reported, not what is learnt
           f"run_dir={run_dir}", "model.warmup_steps=30", "actor.dynamic_sampling=false",
           "trainer.max_steps=12", "trainer.eval_every=12",
           # equal weights: each domain in most of the 12 steps, whatever the recipe's shares (this checks reporting)
           *(f"task.args.domains.{d}.weight=1" for d in DOMAINS),
           "trainer.samples_per_step=48", "task.args.domains.add.args.num_eval=24",
           "task.args.domains.backward.args.num_eval=24", "task.args.domains.constraints.args.num_eval=24"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward_mean" in row]
    evals = [row for row in rows if "eval_accuracy" in row]
    assert [e["step"] for e in evals] == [0, 12]
    for domain in DOMAINS:
        trained = [row[f"domain_{domain}_accuracy"] for row in steps if f"domain_{domain}_accuracy" in row]
        assert len(trained) >= 6, f"{domain} trained in too few steps"
        assert all(f"domain_{domain}_lag_mean" in row for row in steps if f"domain_{domain}_accuracy" in row)
        assert all(f"eval_{domain}_avg@2" in e for e in evals)
    # the mean over the three benchmarks, not over their pooled problems
    last = evals[-1]
    assert last["eval_accuracy"] == pytest.approx(sum(last[f"eval_{d}_avg@2"] for d in DOMAINS) / 3)
    # each domain's own max_new_tokens (add 6, backward 8, constraints 40)
    for domain, cap in (("add", 6), ("backward", 8), ("constraints", 40)):
        assert max(row[f"domain_{domain}_output_tokens_mean"] for row in steps
                   if f"domain_{domain}_output_tokens_mean" in row) <= cap
    # IFEval's four levels for the constraints benchmark only
    assert {"eval_constraints_prompt_level_strict_acc", "eval_constraints_inst_level_loose_acc"} <= set(last)
    assert not any(k.startswith("eval_add_prompt_level") for k in last)
    # the actor counts each domain's answers and drops apart
    actor = [json.loads(line) for line in (run_dir / "actor_metrics.jsonl").read_text().splitlines()][-1]
    assert sum(actor[f"domain_{d}_samples_generated"] for d in DOMAINS) == actor["samples_generated"]
    assert actor["reward_timeouts"] == 0 and actor["reward_errors"] == 0  # every domain's verifier warmed up
    assert (run_dir / "domains.png").exists() and (run_dir / "eval_benchmarks.png").exists()
