"""Multi-node launching on one machine: two `pipelinerl run` launchers with WORLD_SIZE=2 and RANK 0 / 1 meet at
MASTER_ADDR:MASTER_PORT on loopback, as two nodes of a cluster would (shared run directory, as on a shared
filesystem). Node 0 runs a two-process data-parallel trainer (torchrun, gloo) beside its engine."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl.procs import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def start_node(rank: int, master_port: int, run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_cpu.yaml"),
           f"run_dir={run_dir}", "model.warmup_steps=0", "model.tiny_hidden_size=64", "sampling.max_new_tokens=16",
           "sampling.group_size=4", "trainer.samples_per_step=16", "actor.dynamic_sampling=false",
           "actor.concurrency=8", "trainer.eval_every=0", *overrides]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master_port),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(run_dir.parent / f"node{rank}.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def output(run_dir: Path, rank: int) -> str:
    return (run_dir.parent / f"node{rank}.out").read_text()


def stop_all(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def test_two_nodes_train_with_engines_on_both(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    node1 = start_node(1, port, run_dir, "trainer.max_steps=5", "trainer.num_processes=2")
    node0 = start_node(0, port, run_dir, "trainer.max_steps=5", "trainer.num_processes=2")
    try:
        assert node0.wait(timeout=500) == 0, output(run_dir, 0)[-3000:]
        assert node1.wait(timeout=60) == 0, output(run_dir, 1)[-3000:]
    finally:
        stop_all(node0, node1)
    assert "the run is over (ok)" in output(run_dir, 1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["samples"] == 16 for r in rows)  # each step trained on a full batch
    # node 0's engine is engine0, node 1's is engine1: both hold the final weights and both generated
    for i in (0, 1):
        engine = json.loads((run_dir / f"engine{i}_metrics.json").read_text())
        assert engine["pipelinerl_weight_version"] == 5, i
        assert engine["pipelinerl_generated_tokens_total"] > 0, i
    # the trainer really ran as two processes
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "joined weight-update group" in trainer_log
    assert (run_dir / "final_model" / "config.json").exists()


def test_an_engine_dying_on_another_node_stops_the_run_naming_it(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    node1 = start_node(1, port, run_dir, "trainer.max_steps=100000")
    node0 = start_node(0, port, run_dir, "trainer.max_steps=100000")
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert node0.poll() is None and node1.poll() is None, output(run_dir, 0)[-2000:]
            assert time.monotonic() < deadline, "no training steps within 300 s"
            time.sleep(0.5)
        pids = json.loads((run_dir / "logs" / "node1" / "pids.json").read_text())
        os.kill(pids["engine0"], signal.SIGKILL)
        assert node1.wait(timeout=60) == 1
        assert node0.wait(timeout=120) == 1
    finally:
        stop_all(node0, node1)
    out0 = output(run_dir, 0)
    assert "node 1 failed: engine0 exited with code -9" in out0, out0[-3000:]
    # node 0 stopped its own processes on the way out
    for pid in json.loads((run_dir / "pids.json").read_text()).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
