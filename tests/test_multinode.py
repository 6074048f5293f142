"""Multi-node launching on one machine: two `pipelinerl run` launchers with WORLD_SIZE=2 and RANK 0 / 1 meet at
MASTER_ADDR:MASTER_PORT on loopback, as two nodes of a cluster would (shared run directory, as on a shared
filesystem). The trainer spans both nodes (trainer.num_nodes=2: one process on each, torchrun over gloo), and
each node runs an engine beside its trainer process."""

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

TRAINER_OVER_TWO_NODES = ("trainer.num_nodes=2", "trainer.num_processes=2")


def start_node(rank: int, master_port: int, run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_cpu.yaml"),
           f"run_dir={run_dir}", "model.warmup_steps=0", "model.tiny_hidden_size=64", "sampling.max_new_tokens=16",
           "sampling.group_size=4", "trainer.samples_per_step=16", "actor.dynamic_sampling=false",
           "actor.concurrency=8", "trainer.eval_every=0", *TRAINER_OVER_TWO_NODES, *overrides]
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


def assert_all_gone(pids_json: Path) -> None:
    """Every process the file lists has exited (within a few seconds: a child dies just after its parent)."""
    pids = json.loads(pids_json.read_text())
    deadline = time.monotonic() + 10
    for name, pid in pids.items():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"{name} (pid {pid}) of {pids_json} still runs"
            time.sleep(0.2)


def test_a_trainer_over_two_nodes_trains_and_updates_the_engines_of_both(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    node1 = start_node(1, port, run_dir, "trainer.max_steps=4")
    node0 = start_node(0, port, run_dir, "trainer.max_steps=4")
    try:
        assert node0.wait(timeout=300) == 0, output(run_dir, 0)[-3000:]
        assert node1.wait(timeout=90) == 0, output(run_dir, 1)[-3000:]
    finally:
        stop_all(node0, node1)
    out1 = output(run_dir, 1)
    # node 1 ran trainer rank 1 (without it node 0's rank 0 could not have formed its group of 2) and stopped it
    assert "trainer rank 1 started" in out1 and "the run is over (ok)" in out1, out1[-3000:]
    assert_all_gone(run_dir / "logs" / "node1" / "pids.json")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # written by rank 0 alone: one row per step
    assert all(r["samples"] == 16 for r in rows)  # each step trained on a full batch
    # node 0's engine is engine0, node 1's is engine1: both hold the final weights and both generated
    for i in (0, 1):
        engine = json.loads((run_dir / f"engine{i}_metrics.json").read_text())
        assert engine["pipelinerl_weight_version"] == 4, i
        assert engine["pipelinerl_generated_tokens_total"] > 0, i
    assert (run_dir / "final_model" / "config.json").exists()


def test_a_trainer_node_that_dies_stops_the_run_naming_it(tmp_path):
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
        node1.kill()  # the whole node: its launcher, with nothing left to report; its children die with it
        assert node0.wait(timeout=120) == 1
    finally:
        stop_all(node0, node1)
    out0 = output(run_dir, 0)
    assert "node 1 is gone" in out0, out0[-3000:]
    # node 0 stopped its own processes on the way out; node 1's died with their launcher
    assert_all_gone(run_dir / "pids.json")
    assert_all_gone(run_dir / "logs" / "node1" / "pids.json")
