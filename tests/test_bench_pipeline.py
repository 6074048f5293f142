"""The arithmetic of bench/pipeline_vs_sync.py's throughput benchmark, on metrics rows written by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pipeline_vs_sync import summarize


def rows(waits: list[float], steps: list[float], left_out: list[float], samples: int = 32) -> list[dict]:
    """The trainer's metrics rows of a run whose step i waited waits[i] for its batch, then trained steps[i]
    seconds (broadcast included, as 0.1 s of it), plus one held-out evaluation row, which is not a step."""
    out, now = [{"step": 0, "eval_accuracy": 0.5}], 0.0
    for i, (wait, step, skipped) in enumerate(zip(waits, steps, left_out)):
        now += wait + step
        out.append({"step": i + 1, "time": now, "samples": samples, "samples_total": samples * (i + 1),
                    "samples_per_s": samples / (wait + step), "wait_for_samples_s": wait,
                    "step_s": step - 0.1, "broadcast_s": 0.1, "samples_left_out": skipped})
    return out


def test_a_perfectly_overlapped_run_reaches_the_bound_when_step_lengths_vary():
    """Steps of 1, 1, 1 and 9 s (samples without advantage skip the trainer): generation (3 s a batch) hides
    behind training only on average. The bound comes from means, as samples/s does, so a pipelined run that
    never waits gets exactly the bound; medians (T_train 1 s) would put the bound at 4 and this run at half."""
    train = [1.0, 1.0, 1.0, 9.0] * 3
    sync = rows([3.0] * 12, train, [24, 24, 24, 0] * 3)
    pipelined = rows([0.0] * 12, train, [24, 24, 24, 0] * 3)
    got = summarize(pipelined, sync, skip=3)  # steps 5-12: two whole cycles
    assert got["t_gen_s"] == pytest.approx(3.0)
    assert got["t_train_s"] == pytest.approx(3.0)
    assert got["bound"] == pytest.approx(2.0)
    assert got["samples_per_s"]["sync"] == pytest.approx(32 / 6)
    assert got["ratio"] == pytest.approx(2.0)
    assert got["fraction_of_bound"] == pytest.approx(1.0)
    assert got["passed"]
    assert got["medians"]["sync"]["t_train_s"] == pytest.approx(1.0)


def test_a_pipelined_trainer_slowed_by_generation_falls_short_and_shows_where():
    """The pipelined run's trainer takes 20% longer per sample it trains on than the synchronous one's: it
    misses 90% of the bound, and the result says so per trained sample whatever the share left out."""
    sync = rows([4.0] * 10, [4.0] * 10, [16] * 10)
    pipelined = rows([0.0] * 10, [4.0 * 1.2 * 20 / 16] * 10, [12] * 10)  # 20 trained instead of 16
    got = summarize(pipelined, sync, skip=2)
    assert got["bound"] == pytest.approx(2.0)
    assert not got["passed"]
    assert got["samples_trained_per_step"] == {"sync": pytest.approx(16), "pipelined": pytest.approx(20)}
    per = got["trainer_s_per_trained_sample"]
    assert per["pipelined"] / per["sync"] == pytest.approx(1.2)


def test_step_cost_splits_each_interval_into_its_stages():
    """bench/step_cost.py: a step's after-the-row time is what the step before it did after its row, so it is
    paired with the interval it fell in; what no stage covers is `unaccounted`, and the stages add up to the
    interval."""
    from bench.step_cost import STAGES, stage_rows

    def row(step: int, time: float, after: float) -> dict:
        return {"step": step, "time": time, "samples": 64, "samples_per_s": 1.0, "wait_for_samples_s": 0.010,
                "step_s": 0.020, "step_prepare_s": 0.004, "step_policy_s": 0.012, "step_critic_s": 0.0,
                "broadcast_s": 0.005, "publish_s": 0.008, "after_last_row_s": after, "checkpoint_s": 0.001,
                "group_generate_s_mean": 0.03}

    rows = [row(1, 1.0, 0.0), {"step": 1, "eval_accuracy": 0.5}, row(2, 1.050, 0.002), row(3, 1.090, 0.001)]
    got = stage_rows(rows, skip=0)
    assert len(got) == 2
    first = got[0]
    assert first["interval_s"] == pytest.approx(0.050)
    assert first["step_rest_s"] == pytest.approx(0.004)
    assert first["publish_rest_s"] == pytest.approx(0.003)
    assert first["waiting_s"] == pytest.approx(0.009) and first["checkpoint_s"] == pytest.approx(0.001)
    assert first["unaccounted_s"] == pytest.approx(0.050 - 0.010 - 0.020 - 0.008 - 0.002)
    for stage in got:
        assert sum(stage[key] for _, key in STAGES) == pytest.approx(stage["interval_s"])
    assert stage_rows(rows, skip=1) == got[1:]


# --- bench/compare_long.py: the race to the synchronous run's accuracy ----------------------------------------------

def _race_run(points: list[tuple[float, float]], samples_per_s: float = 1.0) -> dict:
    evals = [{"step": 10 * i, "accuracy": acc, "train_s": t} for i, (t, acc) in enumerate(points)]
    return {"evals": evals, "samples_per_s": samples_per_s, "end_s": points[-1][0]}


def test_the_race_sets_targets_from_the_synchronous_mean_curve_and_times_each_arm_on_its_own():
    from bench.compare_long import analyse

    sync = [_race_run([(0, 0.1), (100, 0.2), (200, 0.5)]), _race_run([(0, 0.1), (120, 0.4), (220, 0.5)])]
    fast = [_race_run([(0, 0.1), (40, 0.45), (80, 0.6)], 3.0), _race_run([(0, 0.1), (60, 0.35), (100, 0.5)], 2.0)]
    got = analyse({"sync": sync, "pipelined": fast})
    assert got["base_accuracy"] == pytest.approx(0.1) and got["sync_final_accuracy"] == pytest.approx(0.5)
    assert got["targets"]["50%"] == pytest.approx(0.3) and got["targets"]["90%"] == pytest.approx(0.46)
    s, p = got["arms"]["sync"], got["arms"]["pipelined"]
    # the synchronous mean curve: (0, 0.1), (110, 0.3), (210, 0.5); the pipelined one (0, 0.1), (50, 0.4), (90, 0.55)
    assert s["seconds_to_target"]["50%"] == pytest.approx(110)
    assert p["seconds_to_target"]["50%"] == pytest.approx(50 * 2 / 3)
    assert p["speedup_over_sync"]["50%"] == pytest.approx(110 / (100 / 3))
    assert s["speedup_over_sync"]["90%"] == pytest.approx(1.0)
    assert p["samples_per_s"] == pytest.approx(2.5) and p["samples_per_s_spread"] == [2.0, 3.0]
    assert p["seconds_to_target_per_seed"]["50%"] == pytest.approx([40 * 0.2 / 0.35, 60 * 0.2 / 0.25])
    # equal wall-clock: when the faster arm finished (its mean end, 90 s), the synchronous one had its base only
    assert got["equal_wall_clock_s"] == pytest.approx(90)
    assert p["accuracy_at_equal_wall_clock"] == pytest.approx(0.55) and s["accuracy_at_equal_wall_clock"] == 0.1

    flat = analyse({"sync": [_race_run([(0, 0.3), (100, 0.3)])], "pipelined": fast})
    assert flat["targets"] == {} and "did not learn" in flat["why"]


def test_the_race_arms_are_valid_settings_and_one_step_refuses_another_lag():
    from bench.compare_long import ARMS, RECIPE, arm_overrides
    from pipelinerl.config import ConfigError, load_config

    for arm in ARMS:
        cfg = load_config(RECIPE, ["run_dir=/tmp/x", "model.path=/tmp/m", *arm_overrides(arm, max_lag=2)])
        assert cfg.actor.one_step_off_policy == (arm == "one_step")
        assert cfg.actor.max_lag == {"sync": 0, "one_step": 1, "pipelined": 2}[arm]
    with pytest.raises(ConfigError, match="actor.one_step_off_policy.*actor.max_lag: 1"):
        load_config(RECIPE, ["run_dir=/tmp/x", "model.path=/tmp/m", "actor.one_step_off_policy=true",
                             "actor.max_lag=2"])


def test_a_race_run_ends_with_its_last_evaluation():
    """The last held-out evaluation's row comes after the last step's: the run's end (equal wall-clock) is there,
    so the fastest arm's final accuracy counts at its own end."""
    from bench.compare_long import summarise_run

    rows = [{"step": 0, "time": 0.0, "eval_accuracy": 0.1, "eval_seconds": 5.0}]
    for step in (1, 2):
        rows.append({"step": step, "time": 5.0 + 10 * step, "samples": 4, "samples_total": 4 * step,
                     "samples_per_s": 0.4})
    rows.append({"step": 2, "time": 25.5, "eval_accuracy": 0.3, "eval_seconds": 5.0})
    got = summarise_run(rows, Path("/nonexistent"), skip=0)
    assert got["end_s"] == pytest.approx(20.5) and got["evals"][-1]["train_s"] == pytest.approx(20.5)
