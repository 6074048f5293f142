"""bench/vs_trl.py's arithmetic: time to a held-out accuracy, pipelinerl's clocks with evaluations left out, the
choice of target and best learning rates, and (where TRL is installed) the GRPOConfig it builds from a recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.vs_trl import (
    analyse,
    common_overrides,
    diverged,
    is_heavy,
    lr_grid,
    pipelinerl_curves,
    run_cost_s,
    seconds_per_step,
    time_to_accuracy,
)

ROOT = Path(__file__).resolve().parents[1]


def test_time_to_accuracy_interpolates_the_first_crossing():
    curve = [(0.0, 0.10), (10.0, 0.20), (20.0, 0.40), (30.0, 0.30), (40.0, 0.50)]
    assert time_to_accuracy(curve, 0.30) == pytest.approx(15.0)  # halfway between 0.20 at 10 s and 0.40 at 20 s
    assert time_to_accuracy(curve, 0.40) == pytest.approx(20.0)  # an evaluation exactly at the target
    assert time_to_accuracy(curve, 0.45) == pytest.approx(37.5)  # from the dip: 0.30 at 30 s -> 0.50 at 40 s
    assert time_to_accuracy(curve, 0.05) == 0.0  # already there at the start
    assert time_to_accuracy(curve, 0.60) is None


def test_pipelinerl_clock_leaves_evaluations_out():
    # the trainer's clock runs on through its evaluations (2 s, then 3 s); each row's train_s subtracts those before it
    rows = [{"step": 0, "time": 0.5, "eval_accuracy": 0.1, "eval_seconds": 2.0},
            {"step": 1, "time": 3.5, "samples_per_s": 64.0, "samples": 64},
            {"step": 2, "time": 4.5, "samples_per_s": 64.0, "samples": 64},
            {"step": 2, "time": 4.6, "eval_accuracy": 0.3, "eval_seconds": 3.0},
            {"step": 3, "time": 8.6, "samples_per_s": 64.0, "samples": 64}]
    # rows seen 0.5 s after the trainer wrote them, the third 0.6 s (it waited for the next poll); the trainer
    # started 10.2 s after the command (wall 1000)
    seen = [1010.7, 1013.7, 1014.8, 1014.8, 1018.8]
    out = pipelinerl_curves(rows, seen, launch_wall=1000.0)
    assert [e["train_s"] for e in out["evals"]] == pytest.approx([0.5, 2.6])
    assert [s["train_s"] for s in out["steps"]] == pytest.approx([1.5, 2.5, 3.6])
    assert out["eval_seconds_total"] == pytest.approx(5.0)
    # the start is estimated from the rows seen soonest after they were written: 10.2 s after the launch
    assert [e["launch_s"] for e in out["evals"]] == pytest.approx([10.7, 12.8])
    assert out["start"] == pytest.approx({"train_s": 0.0, "launch_s": 10.2})  # step 0's model, for its exports
    assert seconds_per_step(out["steps"], skip_frac=0.0) == pytest.approx((3.6 - 1.5) / 2)


def _run(side: str, lr: float, curve: list[tuple[int, float, float]]) -> dict:
    return {"side": side, "lr": lr, "evals": [{"step": s, "accuracy": a, "launch_s": t, "train_s": t}
                                              for s, a, t in curve]}


def test_analyse_targets_the_lower_best_final_and_takes_each_sides_fastest_lr():
    runs = [_run("pipelinerl", 1e-3, [(0, 0.10, 5), (50, 0.30, 25), (100, 0.50, 45)]),
            _run("pipelinerl", 3e-3, [(0, 0.12, 5), (50, 0.45, 25), (100, 0.40, 45)]),
            _run("trl", 1e-3, [(0, 0.10, 2), (50, 0.20, 40), (100, 0.40, 80)]),
            _run("trl", 3e-3, [(0, 0.08, 2), (50, 0.25, 40), (100, 0.35, 80)])]
    out = analyse(runs, target_fraction=0.5)
    assert out["base_accuracy"] == pytest.approx(0.10)
    assert out["best_final_accuracy"] == {"pipelinerl": 0.50, "trl": 0.40}
    assert out["target_accuracy"] == pytest.approx(0.25)  # halfway from 0.10 to the lower best final, TRL's 0.40
    # pipelinerl's fastest to 0.25 is its lr 3e-3 run (5 + 0.13/0.33 * 20 s), not its best final one
    assert out["best"]["pipelinerl"]["lr"] == 3e-3
    assert out["best"]["pipelinerl"]["seconds_to_target"] == pytest.approx(5 + 20 * 0.13 / 0.33)
    assert out["best"]["trl"]["lr"] == 3e-3  # reaches 0.25 exactly at its step-50 evaluation, 40 s
    assert out["ratio"] == pytest.approx(40 / (5 + 20 * 0.13 / 0.33))
    assert analyse(runs, target_fraction=1.0)["best"]["trl"]["seconds_to_target"] == pytest.approx(80)


def test_analyse_says_why_when_nothing_learned():
    runs = [_run("pipelinerl", 1e-3, [(0, 0.2, 5), (10, 0.2, 10)]), _run("trl", 1e-3, [(0, 0.2, 2), (10, 0.1, 9)])]
    out = analyse(runs)
    assert out["ratio"] is None and out["target_accuracy"] is None
    assert "no learning" in out["why"]
    assert analyse(runs[:1])["why"] == "a side has no finished run"


def test_heavy_workload_and_lr_grid():
    assert is_heavy(24_000_000, 176) and not is_heavy(500_000, 6) and not is_heavy(24_000_000, 64)
    assert lr_grid(1e-3) == [0.0001, 0.000333, 0.001, 0.003]


def test_diverged_means_below_half_the_start_at_three_evaluations_in_a_row():
    assert diverged([0.13, 0.04, 0.03, 0.01])
    assert not diverged([0.13, 0.04, 0.03])  # only two evaluations after the start
    assert not diverged([0.13, 0.04, 0.03, 0.07, 0.05])  # a recovery to above half the start
    assert not diverged([0.13, 0.10, 0.08, 0.07])  # below the start but not by half: a dip, not a collapse
    assert not diverged([0.0, 0.0, 0.0, 0.0])  # nothing to fall from


def test_trl_config_matches_the_recipe():
    pytest.importorskip("trl")
    from bench.vs_trl import trl_config
    from pipelinerl.config import load_config

    cfg = load_config(ROOT / "recipes" / "tiny_cpu.yaml",
                      ["run_dir=unused", *common_overrides(Path("/nonexistent"), 3e-3, 200, 20)])
    args = trl_config(cfg, 3e-3, 200, Path("/tmp/unused"))
    # one optimizer step: 64 samples generated by the current policy, 8 prompts x 8, trained on once
    assert args.generation_batch_size == cfg.trainer.samples_per_step == 64
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64
    assert args.steps_per_generation == 1 and args.num_iterations == 1
    assert args.num_generations == cfg.sampling.group_size == 8
    assert args.max_completion_length == cfg.sampling.max_new_tokens
    assert (args.temperature, args.top_p, args.top_k) == (1.0, 1.0, 0)
    assert args.beta == 0.0 and (args.epsilon, args.epsilon_high) == (0.2, 0.28)
    assert args.learning_rate == 3e-3 and args.max_steps == 200 and args.warmup_steps == cfg.trainer.warmup_steps
    assert args.lr_scheduler_type == "cosine"
    assert not args.bf16 and not args.gradient_checkpointing and args.use_cpu
    # bf16 autocast on both sides or on neither
    cfg = load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=unused", "trainer.mixed_precision=bf16"])
    assert trl_config(cfg, 3e-3, 200, Path("/tmp/unused")).bf16


def test_a_runs_exports_are_evaluated_after_it_at_their_steps_clocks(tmp_path):
    import shutil

    from bench.vs_trl import TINY_RECIPE, evaluate_exports
    from pipelinerl.models.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, seed=1)
    run_dir = tmp_path / "run"
    for step, seed in ((2, 2), (4, 3), (6, 4)):  # step 6: exported by a run stopped before its row was written
        build_tiny_model(run_dir / "exports" / f"step_{step}", hidden_size=32, num_layers=1, seed=seed)
    curves = {"start": {"train_s": 0.0, "launch_s": 9.0},
              "steps": [{"step": s, "samples": 8, "train_s": 1.5 * s, "launch_s": 9.0 + 1.5 * s} for s in (1, 2, 3, 4)]}
    overrides = [f"run_dir={run_dir}", f"model.path={base}", "task.num_eval=8", "trainer.eval_k=2"]
    evals, seconds = evaluate_exports(TINY_RECIPE, run_dir, overrides, base, curves, threads=1)
    assert [(e["step"], e["train_s"], e["launch_s"]) for e in evals] == [(0, 0.0, 9.0), (2, 3.0, 12.0), (4, 6.0, 15.0)]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals) and seconds > 0
    assert not (run_dir / "exports").exists(), "evaluated exports are deleted"
    # an export that does not load fails the benchmark, naming the worker's log
    (run_dir / "exports" / "step_2").mkdir(parents=True)
    shutil.copy(base / "config.json", run_dir / "exports" / "step_2")
    with pytest.raises(RuntimeError, match=r"run\.eval\.log"):
        evaluate_exports(TINY_RECIPE, run_dir, overrides, base, curves, threads=1)


def test_a_runs_cost_counts_its_evaluations_wherever_they_ran():
    """The next run's default budget is 3x the costliest run so far: pipelinerl's evaluations after its run count,
    as TRL's inside its run do (a TRL run evaluating every 5 steps was stopped at 3x pipelinerl's bare 215 s)."""
    pipelinerl = {"wall_s": 215.0, "eval_seconds_total": 230.0, "evaluated": "exports"}
    trl = {"wall_s": 640.0, "eval_seconds_total": 250.0, "evaluated": "in the run"}
    assert run_cost_s(pipelinerl) == 445.0 and run_cost_s(trl) == 640.0
    assert 3 * run_cost_s(pipelinerl) > run_cost_s(trl)
