"""The CPU rehearsal of the Open-Reasoner-Zero path (recipes/orz_cpu.yaml): problems read from files in ORZ's
formats, ORZ's prompt template, stop strings ending generations at `</answer>` (kept, finish_reason "stop"),
the ORZ reward, per-benchmark evaluation with its own sampling settings, plots; and, with ORZ's method (PPO with a
critic, GAE), the reward rises and held-out accuracy does not fall."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipelinerl.config import StreamsConfig
from pipelinerl.plot import generated_accuracy
from pipelinerl.streams import open_reader
from pipelinerl.tasks.synthetic_math import write_synthetic_orz

ROOT = Path(__file__).resolve().parents[1]


def _samples(run_dir: Path) -> list[dict]:
    reader = open_reader(StreamsConfig(), run_dir, "samples")
    return list(reader.read())


# `make rehearsal-seeds` runs the rehearsal on several seeds (PIPELINERL_REHEARSAL_SEEDS=0,1,2,...); make test on one
SEEDS = [int(s) for s in os.environ.get("PIPELINERL_REHEARSAL_SEEDS", "0").split(",")]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 4 minutes on 2 cores (a 150-step warm-up, then 80 RL steps); room for a busy CI
@pytest.mark.parametrize("seed", SEEDS)
def test_orz_path_on_cpu_stops_at_answer_and_learns(tmp_path, seed):
    data = tmp_path / "data"
    write_synthetic_orz(data)
    run_dir = tmp_path / "orz"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "orz_cpu.yaml"),
           f"run_dir={run_dir}", f"seed={seed}", f"task.args.train_data=[{data}/train.json]",
           f"task.args.eval_data=[{data}/eval/add.json,{data}/eval/sub.json,{data}/eval/choice.json]",
           # the recipe's 150 steps shortened to 80 (the cosine schedule with them): the reward has risen by then
           "trainer.max_steps=80", "trainer.eval_every=40",
           # half the recipe's warm-up steps of half its batch, which was most of the test's time: enough for the
           # format (99% of the run's outputs end at </answer>), fewer answers are right, and RL has more to raise
           # (measured 0.18 -> 0.40). Batches of 32 instead of 64: 49 s instead of 80, held-out avg@4 0.065 / 0.160
           # (addition / subtraction) against 0.048 / 0.173, 2.5% of outputs cut at 48 tokens against 0.5%
           "model.warmup_steps=150", "model.warmup_batch_size=32"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd += [a for a in os.environ.get("PIPELINERL_REHEARSAL_ARGS", "").split() if a]  # trying other settings
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward_mean" in row]
    evals = [row for row in rows if "eval_accuracy" in row]

    # generations end at the stop string "</answer>", which stays in the output, with finish_reason "stop"
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "base_model")
    samples = _samples(run_dir)
    assert len(samples) >= 64
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert len(stopped) >= 0.8 * len(samples), "most generations should end at a stop string"
    texts = [tokenizer.decode(s["output_token_ids"], skip_special_tokens=True) for s in stopped]
    at_answer = [t for t in texts if t.rstrip().endswith("</answer>") and t.count("</answer>") == 1]
    assert len(at_answer) >= 0.9 * len(stopped), texts[:5]
    assert all(len(s["behav_logprobs"]) == len(s["versions"]) == len(s["output_token_ids"]) for s in stopped)

    # reward rises (ORZ's: 1 for a correct \boxed{} in the <answer> block of an output that stopped), the trained
    # batches' mean (dynamic sampling keeps the groups with a signal) over the first 10 steps against the second
    # half. Seeds 0-5 (`make rehearsal-seeds`, docs/algorithms.md): +0.128, +0.115, +0.078, +0.081, +0.080,
    # +0.144. The last 15 steps alone swing too much between runs to compare against.
    first = sum(row["reward_mean"] for row in steps[:10]) / 10
    later = steps[len(steps) // 2:]
    second_half = sum(row["reward_mean"] for row in later) / len(later)
    held_out = " -> ".join(f"{e['eval_accuracy']:.3f}" for e in evals)
    print(f"seed {seed}: reward {first:.3f} -> {second_half:.3f}; held-out {held_out}")
    assert second_half > first + 0.03, f"reward {first:.3f} -> {second_half:.3f}"

    # per-benchmark evaluation, before and after, with the mean over benchmarks
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps[-1]["step"]
    for bench in ("add", "sub", "choice"):
        assert any(key.startswith(f"eval_{bench}_") for key in evals[-1]), sorted(evals[-1])
    # Learning is asserted on the training reward above. The held-out mean rose on seeds 0-5 (by 0.004-0.043; at
    # the recipe's former lr 5e-4 it fell on one seed, 0.089 -> 0.073): 80 steps of a tiny model do not carry to
    # held-out benchmarks reliably. What must hold on every seed is that training does not wreck it.
    assert evals[-1]["eval_accuracy"] >= evals[0]["eval_accuracy"] - 0.05, [e["eval_accuracy"] for e in evals]
    eval_files = sorted((run_dir / "eval").glob("step_*.md"))
    assert eval_files and "add" in eval_files[-1].read_text()
    assert (run_dir / "curves_time.png").exists()
    # the actor counted every answer it scored, the groups dynamic sampling dropped too: over the first and last
    # quarter of the run it rose on seeds 2-5 (0.121 -> 0.157 on seed 5), on seed 2 barely (0.124 -> 0.128; seeds 0-1
    # not recorded); not asserted to rise
    windows = generated_accuracy(run_dir)
    assert len(windows) >= 5 and all(0 <= w["generated_accuracy"] <= 1 for w in windows)
