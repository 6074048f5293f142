"""A whole run survives faults injected while it runs (tests/helpers/chaos.py): a short walk in `make test`, with every
kind of fault once; `make chaos` runs several seeds for longer, faults drawn at random (PIPELINERL_CHAOS_SEEDS,
PIPELINERL_CHAOS_STEPS, PIPELINERL_CHAOS_FAULTS)."""

from __future__ import annotations

import os

import pytest
from helpers.chaos import FAULTS, Chaos

pytestmark = pytest.mark.slow


def test_a_run_survives_one_of_every_fault(tmp_path):
    plan = ["kill_engine", "kill_reward_worker", "corrupt_stream", "stop_engine", "fill_disk", "stop_actor",
            "kill_trainer", "kill_actor"]
    chaos = Chaos(tmp_path / "run", seed=0, steps=120, faults=plan)
    report = chaos.run(max_faults=len(plan))
    print(report.summary())
    assert report.survived, report.summary()
    assert set(report.injected) >= set(plan) - (set() if chaos.disk else {"fill_disk"}), report.summary()
    assert report.corrupt_counted >= 1
    if chaos.disk:  # the tmpfs under the checkpoints was there: a periodic save met the full disk
        assert report.checkpoints_refused >= 1, report.summary()


@pytest.mark.skipif(not os.environ.get("PIPELINERL_CHAOS_SEEDS"), reason="make chaos: PIPELINERL_CHAOS_SEEDS")
def test_runs_survive_random_faults(tmp_path):
    seeds = [int(s) for s in os.environ["PIPELINERL_CHAOS_SEEDS"].split(",")]
    steps = int(os.environ.get("PIPELINERL_CHAOS_STEPS", "200"))
    faults = int(os.environ.get("PIPELINERL_CHAOS_FAULTS", "12"))
    reports = [Chaos(tmp_path / f"run{seed}", seed, steps, timeout_s=3600).run(max_faults=faults) for seed in seeds]
    for r in reports:
        print(r.summary())
    injected = sum(len(r.injected) for r in reports)
    print(f"chaos: {sum(r.survived for r in reports)} of {len(reports)} runs survived {injected} faults "
          f"({', '.join(f'{f} {sum(r.injected.count(f) for r in reports)}' for f in FAULTS)})")
    assert all(r.survived for r in reports), "\n".join(r.summary() for r in reports)
