"""SIGTERM ends a whole run in bounded time whatever is in flight, and leaves no process behind: here every reward
worker is stuck in a check (a verifier that sleeps for minutes) while engines generate and the trainer waits for
samples. The launcher stops the actor (whose reward pool kills its stuck workers) and the trainer (which saves a
checkpoint) together, then every engine at once. An engine alone ends within seconds of SIGTERM even while a
rendezvous never answers (tests/test_control_routes.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_a_run_whose_reward_workers_are_stuck(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "SLOW_REWARD_S": "600",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl.cli", "run", "recipes/tiny_cpu.yaml", f"run_dir={run_dir}",
         "model.warmup_steps=0", "trainer.eval_every=0", "task.reward_fn=helpers.slow_reward:score",
         "reward.timeout_s=900", "reward.workers=2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (run_dir / "pids.json").exists(), "the run's processes started", timeout_s=240)
        pids = json.loads((run_dir / "pids.json").read_text())
        wait_until(lambda: "engine_urls" in os.listdir(run_dir / "logs"), "the engines answered", timeout_s=240)
        time.sleep(5)  # the actor has sent groups to be scored: its workers are in their 600 s checks
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, out
    assert "interrupted by SIGTERM; all processes of the run stopped" in out
    assert took < 40, f"the run took {took:.0f} s to stop after SIGTERM\n{out[-2000:]}"
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    assert not left, f"processes left behind: {left}"
    # and no reward worker either: none of this run's Python processes is alive
    mine = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not mine, f"processes of the run still alive: {mine}"
