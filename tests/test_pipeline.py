"""End to end: `pipelinerl run` starts a real engine, actor, reward pool and trainer as separate processes on a
tiny model. These are the slowest tests (each run starts several Python processes that import torch)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).resolve().parent)

pytestmark = pytest.mark.slow


def run_args(run_dir, *overrides):
    # A random tiny model writing up to 40 tokens per answer: answers are wrong, but long enough for weight
    # updates to land inside them (with 16, the engine sometimes finished every batch between two updates);
    # dynamic sampling is off so all-zero groups still reach the trainer.
    return [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_cpu.yaml"),
            f"run_dir={run_dir}", "model.warmup_steps=0", "model.tiny_hidden_size=64", "sampling.max_new_tokens=40",
            "engine.max_model_len=64",
            "sampling.group_size=4", "trainer.samples_per_step=16", "actor.dynamic_sampling=false",
            "actor.concurrency=16", "trainer.eval_every=0",
            "weight_sync.master_port=0", *overrides]


def launch(run_dir, *overrides, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(run_args(run_dir, *overrides), capture_output=True, text=True, timeout=timeout, env=env)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_pipelined_run_updates_engines_in_flight(tmp_path):
    run_dir = tmp_path / "run"
    # a stream file with a corrupt record, as a crashed writer would leave it
    (run_dir / "streams" / "samples").mkdir(parents=True)
    (run_dir / "streams" / "samples" / "old-writer.jsonl").write_bytes(b"0badc0de {\"torn\n")
    # An update lands inside a generation only when the engine is busy as it arrives. With 16 requests at once and
    # 40 tokens the actor ran ahead of the trainer, then sat at max_lag with the engine idle while updates landed
    # (CI saw 12 steps without one mixed sample). One group at a time of up to 160 tokens makes generation slower
    # than a training step, so the engine is generating whenever an update arrives (mixed samples in ~10 of 11).
    in_flight = ["trainer.max_steps=12", "actor.max_lag=2", "actor.concurrency=4", "sampling.max_new_tokens=160",
                 "engine.max_model_len=192"]
    r = launch(run_dir, *in_flight)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 13))
    assert max(row["lag_max"] for row in rows) >= 1, "pipelined: some samples are from older weights"
    assert all(row["lag_max"] <= 2 for row in rows)
    assert any(row["mixed_version_frac"] > 0 for row in rows), "some samples carry tokens of two versions"
    assert rows[-1]["stream_corrupt"] == 1
    # where each step's time went (bench/step_cost.py): the parts fit in the step, and the stages on the trainer's
    # clock fit in the interval between two rows
    for prev, row in zip(rows, rows[1:]):
        parts = row["step_prepare_s"] + row["step_policy_s"] + row["step_critic_s"]
        assert 0 < parts <= row["step_s"] and row["step_policy_s"] > 0
        assert row["publish_s"] >= row["broadcast_s"] > 0
        assert 0 <= row["checkpoint_s"] <= row["wait_for_samples_s"]
        assert row["wait_for_samples_s"] + row["step_s"] + row["publish_s"] + row["after_last_row_s"] <= (
            row["time"] - prev["time"] + 1e-6)
        assert row["group_generate_s_mean"] > 0 and row["group_reward_s_mean"] > 0
    engine = json.loads((run_dir / "engine0_metrics.json").read_text())
    assert engine["pipelinerl_weight_version"] == 12
    assert engine["pipelinerl_weight_updates_while_running_total"] >= 1
    assert (run_dir / "final_model" / "config.json").exists() and (run_dir / "config.yaml").exists()
    # the engines required the run's own key, which every process had and nothing printed
    key = (run_dir / "api_key").read_text().strip()
    assert (run_dir / "api_key").stat().st_mode & 0o077 == 0 and len(key) >= 32
    assert all(key not in p.read_text(errors="replace") for p in [run_dir / "config.yaml",
                                                                  *(run_dir / "logs").glob("*.log")])
    assert "API key required" in (run_dir / "logs" / "engine0.log").read_text()
    # the trainer says how long it took to set up (beside the engine's start) and then waited (bench/startup.py)
    from bench.startup import SETUP

    assert SETUP.search((run_dir / "logs" / "trainer.log").read_text())
    assert key not in r.stdout + r.stderr
    # a rerun in the same directory resumes from the last checkpoint and continues the version sequence
    r = launch(run_dir, *in_flight, "trainer.max_steps=14")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 15))
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()


def test_one_step_off_policy_generates_each_batch_by_the_version_before_the_one_it_is_trained_at(tmp_path):
    """actor.one_step_off_policy (the baseline of verl's and TRL's asynchronous mode): batch k is generated whole
    by version k - 1 while the trainer trains on batch k - 1, and no update lands in the middle of a batch."""
    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import open_reader

    run_dir = tmp_path / "run"
    r = launch(run_dir, "trainer.max_steps=6", "actor.max_lag=1", "actor.one_step_off_policy=true",
               "sampling.max_new_tokens=160", "engine.max_model_len=192")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 7))
    samples = list(open_reader(StreamsConfig(), run_dir, "samples").read())
    per_batch = 16
    for i, sample in enumerate(samples[:6 * per_batch]):
        batch = i // per_batch
        assert set(sample["versions"]) == {max(0, batch - 1)}, (i, sorted(set(sample["versions"])))
    assert all(row["lag_max"] <= 1 and row["mixed_version_frac"] == 0 and row["stale_dropped"] == 0 for row in rows)
    assert all(row["next_batch_wait_s"] >= 0 for row in rows) and rows[-1]["next_batch_wait_s"] == 0
    engine = json.loads((run_dir / "engine0_metrics.json").read_text())
    assert engine["pipelinerl_weight_updates_while_running_total"] == 0


def test_synchronous_mode_never_trains_on_stale_samples(tmp_path):
    r = launch(tmp_path / "run", "trainer.max_steps=4", "actor.max_lag=0", "metrics.tensorboard=true",
               "trainer.export_every=3", "trainer.entropy_coef=0.01")  # (a gradient though every answer is wrong)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # exports every 3 steps and after the last, each a model that loads; the last is the final model
    exports = tmp_path / "run" / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step_3", "step_4"]
    assert ["export_s" in row for row in rows] == [False, False, True, True]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(exports / "step_3")
    weights = {name: load_file(next((exports / name).glob("*.safetensors"))) for name in ("step_3", "step_4")}
    final = load_file(next((tmp_path / "run" / "final_model").glob("*.safetensors")))
    assert all(weights["step_4"][k].equal(v) for k, v in final.items())
    assert any(not weights["step_3"][k].equal(v) for k, v in final.items()), "step 4 trained after step 3's export"
    assert all(row["lag_max"] == 0 and row["stale_dropped"] == 0 for row in rows)
    assert all(row["mixed_version_frac"] == 0 for row in rows)
    # the same numbers went to TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("lag_max")] == [0.0] * 4


def test_hanging_and_crashing_reward_checks_are_counted_and_the_run_goes_on(tmp_path):
    r = launch(tmp_path / "run", "trainer.max_steps=3", "task.reward_fn=helpers.flaky_reward:score",
               "reward.timeout_s=1", "reward.workers=2", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    actor = [json.loads(line) for line in (tmp_path / "run" / "actor_metrics.jsonl").read_text().splitlines()]
    assert actor[-1]["reward_timeouts"] >= 1 and actor[-1]["reward_crashes"] >= 1
    assert actor[-1]["reward_workers_replaced"] >= 2


def test_a_dead_child_stops_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, "trainer.max_steps=1000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.5)
    pids = json.loads((run_dir / "pids.json").read_text())
    os.kill(pids["actor"], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "actor exited with code -9" in err and "last lines of" in err
    for pid in pids.values():  # nothing is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_trainer_starts_while_the_engines_load_and_its_death_then_stops_the_run(tmp_path):
    """The launcher starts the trainer and the actor beside the engines (they load their models meanwhile and wait
    for the engines' URLs); a trainer that dies before the engines answer stops the run at once, naming it."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, "trainer.max_steps=1000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while not (run_dir / "pids.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    pids = json.loads((run_dir / "pids.json").read_text())
    # the engine writes its port file once it listens, seconds after it started (imports, model)
    assert not (run_dir / "logs" / "engine0.port").exists() and {"trainer", "actor", "engine0"} <= pids.keys()
    os.kill(pids["trainer"], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "trainer exited with code -9" in err and "last lines of" in err
    assert not (run_dir / "metrics.jsonl").exists()
    for pid in pids.values():  # nothing is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if any(row["step"] >= step for row in rows):
            return
        assert time.monotonic() < deadline and proc.poll() is None, f"never reached step {step}"
        time.sleep(0.2)


def _audit(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]


def test_a_trainer_killed_at_a_random_step_resumes_losing_at_most_one_interval(tmp_path):
    """kill -9 of the trainer, then the same command again: at most one checkpoint interval of steps is redone,
    every step is in the metrics once, and every group the trainer took from the stream was trained on exactly
    once or dropped as stale (by group id)."""
    import random
    import re

    from pipelinerl.config import StreamsConfig
    from pipelinerl.streams import open_reader

    run_dir = tmp_path / "run"
    interval, steps = 5, 30
    args = ("trainer.max_steps=30", f"trainer.save_every={interval}", "trainer.save_every_minutes=0",
            "actor.max_lag=2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    kill_at = random.randint(interval + 1, steps - interval - 2)
    _wait_for_step(run_dir, proc, kill_at)
    os.kill(json.loads((run_dir / "pids.json").read_text())["trainer"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "trainer exited with code -9" in err
    reached = max(row["step"] for row in metrics(run_dir))

    r = launch(run_dir, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [int(v) for v in re.findall(r"resumed from \S+ at version (\d+)",
                                           (run_dir / "logs" / "trainer.log").read_text())]
    # (0 when the kill landed just after the checkpoint of the step it reached)
    assert resumed and 0 <= reached - resumed[-1] <= interval, (kill_at, reached, resumed)
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, steps + 1))

    audit = _audit(run_dir)
    assert [row["step"] for row in audit] == list(range(1, steps + 1))
    trained = [g for row in audit for g in row["trained"]]
    dropped = [g for row in audit for g in row["dropped"]]
    assert len(trained) == len(set(trained)) == steps * 4, "a group trained twice"
    assert not set(trained) & set(dropped) and len(dropped) == len(set(dropped))
    # the stream up to where the final checkpoint stands: each of its groups trained or dropped, none lost
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    consumed = json.loads((final / "trainer_state.json").read_text())["data_position"]["consumed_samples"]
    records = list(open_reader(StreamsConfig(), run_dir, "samples").read())[:consumed]
    assert {rec["group_id"] for rec in records} == set(trained) | set(dropped)


def test_sigterm_saves_a_checkpoint_exits_nonzero_and_the_rerun_continues(tmp_path):
    """A stopped run (SIGTERM to the launcher, as a scheduler sends it) is not a success: the trainer saves a
    checkpoint at the step it reached, the launcher exits 143, and the same command continues from there.
    Checkpoints by time keep only the newest; off a terminal progress is plain lines, not a redrawn bar."""
    run_dir = tmp_path / "run"
    args = ("trainer.max_steps=1000", "trainer.save_every_minutes=0.02", "trainer.keep_checkpoints=2",
            "metrics.log_every_s=1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    _wait_for_step(run_dir, proc, 8)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "rerun the same command" in err
    reached = max(row["step"] for row in metrics(run_dir))
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert 1 <= len(checkpoints) <= 2, checkpoints
    assert checkpoints[-1].name == f"step_{reached:08d}", "the stop saved the step it reached"
    assert "stopped by SIGTERM" in (run_dir / "logs" / "trainer.log").read_text()
    assert "\r" not in out and "step " in out and "/1000 (" in out, out[-2000:]

    r = launch(run_dir, "trainer.max_steps=" + str(reached + 3), "trainer.save_every_minutes=0.02")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, reached + 4))


def test_a_dead_engine_is_restarted_rejoins_and_the_run_completes(tmp_path):
    """kill -9 of one of two engines mid-run: the launcher restarts it, the trainer re-forms the weight-update
    group with it at the current version, the actor sends its requests elsewhere meanwhile; the run completes
    with every step once and every group trained once, and the restarted engine generates again."""
    run_dir = tmp_path / "run"
    steps = 20
    args = ("engine.num_engines=2", f"trainer.max_steps={steps}", "trainer.save_every_minutes=0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    _wait_for_step(run_dir, proc, 5)
    os.killpg(json.loads((run_dir / "pids.json").read_text())["engine1"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "engine1 exited with code -9; restarting it (1 of 3" in err
    rows = [row for row in metrics(run_dir) if "reward_mean" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert rows[-1]["engines_rejoined"] == 1
    trained = [g for row in _audit(run_dir) for g in row["trained"]]
    assert len(trained) == len(set(trained)) == steps * 4
    restarted = json.loads((run_dir / "engine1_metrics.json").read_text())
    assert restarted["pipelinerl_weight_version"] == steps, "the restarted engine has the final weights"
    assert restarted["pipelinerl_generated_tokens_total"] > 0, "the restarted engine generated again"


def test_past_its_restart_limit_a_dead_engine_stops_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(run_args(run_dir, "engine.num_engines=2", "engine.max_restarts=0",
                                     "trainer.max_steps=1000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_step(run_dir, proc, 2)
    os.killpg(json.loads((run_dir / "pids.json").read_text())["engine1"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "engine1 exited with code -9" in err and "last lines of" in err


def test_a_run_whose_every_group_is_dropped_stops_with_the_reason(tmp_path):
    """Dynamic sampling on a random model: every group is all wrong, so no sample ever reaches the trainer. The
    actor stops the run after `actor.max_dropped_in_a_row` drops instead of regenerating forever."""
    r = launch(tmp_path / "run", "actor.dynamic_sampling=true", "actor.max_dropped_in_a_row=3",
               "trainer.max_steps=1000")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "actor exited with code 1" in r.stderr
    assert "dynamic sampling dropped 3 groups in a row" in r.stderr and "3 all wrong" in r.stderr
