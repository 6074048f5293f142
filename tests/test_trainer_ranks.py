"""Trainer processes that never hang while the main one works alone (pipelinerl.trainer.ranks).

Only the main trainer process evaluates on the held-out set, talks to the engines and writes the files one process
writes; the others wait for it at a host barrier, outside the collectives of the trainer's process group, whose
timeout (`trainer.collective_timeout_s`) a long evaluation would otherwise trip. Here two trainer processes
(torchrun, gloo) train against a real engine with a collective timeout of a few seconds and an evaluation that
takes longer than that; and a host barrier whose main process never comes fails naming the key to raise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import running_engine

from pipelinerl.config import load_config, save_resolved_config
from pipelinerl.procs import free_port, tail
from pipelinerl.samples import Sample
from pipelinerl.streams import open_writer

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

COLLECTIVE_TIMEOUT_S = 3
# four held-out problems, one answer each, scored one at a time: each evaluation takes over 4 s
SLOW_REWARD_S = 1.0
EVAL_PROBLEMS = 4


def write_run(run_dir: Path, model_dir: Path) -> Path:
    """A run directory as the launcher leaves it for the trainer: the resolved config and one step's samples."""
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={model_dir}", "model.dtype=float32",
        "task.args.digits=2", "task.args.ops=+", f"task.args.num_eval={EVAL_PROBLEMS}",
        "task.reward_fn=helpers.slow_reward:score",
        "reward.timeout_s=30", "sampling.group_size=4", "sampling.max_new_tokens=4", "engine.max_model_len=64",
        "weight_sync.backend=gloo", "weight_sync.timeout_s=60",
        "trainer.samples_per_step=4", "trainer.micro_batch_tokens=64", "trainer.max_steps=1", "trainer.lr=1e-3",
        "trainer.eval_every=1", "trainer.eval_k=1", f"trainer.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"])
    config = save_resolved_config(cfg, run_dir)
    with open_writer(cfg.streams, run_dir, "samples", "test") as samples:
        samples.write_many([Sample(group_id="g0", prompt_token_ids=[5, 6, 7], output_token_ids=out,
                                   behav_logprobs=[-3.0] * len(out), versions=[0] * len(out), finish_reason="stop",
                                   reward=reward).model_dump()
                            for out, reward in (([10, 11], 1.0), ([12], 0.0), ([13, 14, 15], 0.0), ([16], 1.0))])
    return config


@pytest.mark.slow
def test_two_trainer_processes_outlast_an_evaluation_longer_than_the_collective_timeout(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_run(run_dir, tiny_model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_REWARD_S": str(SLOW_REWARD_S),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "trainer.log"
    with running_engine(tiny_model_dir, tmp_path / "logs", extra=["--max-model-len", "64"]) as engine:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "pipelinerl.train", str(config), "--engines", engine.url]
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300)
        assert proc.returncode == 0, f"trainer exited with {proc.returncode}; log {log}:\n{tail(log, 40)}"
        assert engine.info().weight_version == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_accuracy" in r]
    # evaluated before the first step and after the last, each time for longer than a collective may take
    assert [r["step"] for r in evals] == [0, 1]
    assert all(r["eval_seconds"] > COLLECTIVE_TIMEOUT_S for r in evals), [r["eval_seconds"] for r in evals]
    print(f"evaluations took {[round(r['eval_seconds'], 1) for r in evals]} s; collective timeout "
          f"{COLLECTIVE_TIMEOUT_S} s")
    assert [r["step"] for r in rows if "eval_accuracy" not in r] == [1]
    assert (run_dir / "final_model" / "config.json").exists()


# One trainer process at a host barrier, as a script (a spawned process would import this module and conftest):
# rank 1 waits there; rank 0, the main process, never comes but stays up until the file argv[4] exists.
BARRIER_RANK = """
import json, os, sys, time
import torch.distributed as dist
from pipelinerl.trainer import ranks

rank, port, timeout_s, release = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ranks.open_host_barrier(timeout_s)
if rank == 0:
    while not os.path.exists(release):
        time.sleep(0.05)
    os._exit(0)
start = time.monotonic()
try:
    ranks.host_barrier("held-out evaluation")
    outcome = "passed"
except ranks.TrainerRankLost as e:
    outcome = str(e)
print(json.dumps({"outcome": outcome, "waited": time.monotonic() - start}), flush=True)
os._exit(0)
"""


def test_a_main_process_that_never_comes_fails_the_barrier_naming_the_timeout_key(tmp_path):
    port, release, timeout_s = str(free_port()), tmp_path / "release", 2.0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BARRIER_RANK, str(rank), port, str(timeout_s), str(release)],
                              stdout=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:
        out, _ = procs[1].communicate(timeout=120)
    finally:
        release.touch()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    result = json.loads(out.strip().splitlines()[-1])
    message = result["outcome"]
    assert message != "passed"
    assert "trainer.main_process_timeout_s" in message and "after held-out evaluation" in message, message
    assert "trainer process 1" in message and "the main trainer process did not come" in message, message
    assert timeout_s <= result["waited"] < 30, result
