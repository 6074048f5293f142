"""bench/vs_trl.py's arithmetic: time to a held-out accuracy, pipelinerl's clocks with evaluations left out, the
choice of target and best learning rates, and (where TRL is installed) the GRPOConfig it builds from a recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.vs_trl import (
    analyse,
    common_overrides,
    diverged,
    grid_runs,
    is_heavy,
    lr_grid,
    main,
    pipelinerl_curves,
    pool_seeds,
    run_cost_s,
    seconds_per_step,
    seed_bootstrap,
    stall_reason,
    summarise_seeds,
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
    overrides = [f"run_dir={run_dir}", f"model.path={base}", "task.args.num_eval=8", "trainer.eval_k=2"]
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


def _seed_result(noise: float, seed: int) -> dict:
    """A compare_workload result whose two sides learn the same per step (0.60 -> 0.80 -> 0.85 -> 0.86, every 10
    steps) while pipelinerl's steps take 2 s and TRL's 4 s (both start at 0 s), plus `noise` on one step-10
    evaluation: pipelinerl's up, TRL's down, as one evaluation's sampling noise can fall."""
    def row(side: str, s_per_step: float, bump: float) -> dict:
        curve = [(0, 0.60), (10, 0.80 + bump), (20, 0.85), (30, 0.86)]
        return {"side": side, "lr": 1e-4, "held_out": [[k, a, k * s_per_step, k * s_per_step] for k, a in curve],
                "seconds_per_step": s_per_step, "samples_per_s": 32 / s_per_step}
    return {"workload": f"w-seed{seed}", "seeds_family": "w", "recipe": "recipes/counting_cpu.yaml", "heavy": True,
            "target": 2.0, "ratio": None, "settings": {"steps": 30, "eval_every": 10, "seed": seed},
            "machine": {}, "grid": [row("pipelinerl", 2.0, noise), row("trl", 4.0, -noise)], "json": f"s{seed}.json"}


def test_pooled_seeds_cancel_one_evaluations_noise_that_decides_each_seeds_ratio():
    """Each seed's time to the target is placed by the evaluation that first crosses it, so one evaluation's
    noise decides a seed's ratio; on the seeds' mean curves the noise of opposite sign cancels and the ratio is the
    true one: pipelinerl's step is twice as fast and it learns as much per step, so 2.0."""
    seeds = [_seed_result(+0.03, 0), _seed_result(-0.03, 1)]
    for r in seeds:
        r["ratio"] = analyse(grid_runs(r))["ratio"]
    assert seeds[0]["ratio"] > 2.5 and seeds[1]["ratio"] < 1.7  # one evaluation's noise, either way
    out = summarise_seeds(seeds, [0, 1])
    assert out["ratio"] == pytest.approx(2.0) and out["passed"]
    assert out["workload"] == "w-seeds0_1"
    assert out["ratio_per_seed"] == {"0": seeds[0]["ratio"], "1": seeds[1]["ratio"]}
    assert out["ratio_per_seed_median"] == pytest.approx((seeds[0]["ratio"] + seeds[1]["ratio"]) / 2)
    pooled = {r["side"]: r for r in out["grid"]}
    assert [h[1] for h in pooled["pipelinerl"]["held_out"]] == pytest.approx([0.60, 0.80, 0.85, 0.86])
    assert pooled["trl"]["seconds_per_step"] == 4.0
    # resampling the seeds: a draw of seed 0 twice gives its ratio, of seed 1 twice its ratio, so the spread
    # covers both
    spread = out["ratio_seed_bootstrap"]
    assert spread["p05"] == pytest.approx(seeds[1]["ratio"]) and spread["p95"] == pytest.approx(seeds[0]["ratio"])
    assert spread["without_ratio"] == 0


def test_pool_seeds_keeps_the_steps_and_runs_every_seed_has():
    a = [{"side": "trl", "lr": 1e-4, "evals": [{"step": s, "accuracy": acc, "launch_s": t, "train_s": t - 4}
                                                for s, acc, t in [(0, 0.6, 4), (5, 0.7, 34), (10, 0.8, 64)]]},
         {"side": "trl", "lr": 3e-4, "evals": [{"step": 0, "accuracy": 0.6, "launch_s": 4, "train_s": 0}]}]
    b = [{"side": "trl", "lr": 1e-4, "evals": [{"step": s, "accuracy": acc, "launch_s": t, "train_s": t - 6}
                                                for s, acc, t in [(0, 0.7, 6), (10, 0.9, 70)]]}]
    pooled = pool_seeds([a, b])
    assert [(r["side"], r["lr"]) for r in pooled] == [("trl", 1e-4)]  # lr 3e-4 ran in one seed only
    assert [e["step"] for e in pooled[0]["evals"]] == [0, 10]  # step 5 was evaluated in one seed only
    assert [e["accuracy"] for e in pooled[0]["evals"]] == pytest.approx([0.65, 0.85])
    assert [e["launch_s"] for e in pooled[0]["evals"]] == pytest.approx([5, 67])
    assert [e["train_s"] for e in pooled[0]["evals"]] == pytest.approx([0, 62])
    same = [_run("pipelinerl", 1e-4, [(0, 0.6, 5), (10, 0.8, 25)]), _run("trl", 1e-4, [(0, 0.6, 2), (10, 0.8, 42)])]
    spread = seed_bootstrap([same, same, same], draws=50)
    assert spread["p05"] == spread["p95"] == pytest.approx(analyse(same)["ratio"])


def test_seeds_option_runs_whole_comparisons_only():
    for bad in (["--seeds", "0,1", "--seed", "2"], ["--seeds", "0,1", "--only", "trl"], ["--seeds", "0", "--quick"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2


def test_a_run_its_actor_stopped_for_dynamic_samplings_stall_counts_as_stopped(tmp_path, tiny_model_dir):
    """The tiny recipe at lr 1e-3 ended with about 7% of its groups kept, and its actor stopped it at step 856 of
    1000 (80 groups dropped in a row): the comparison counts its evaluations so far, as a diverged run's, where it
    used to fail as a whole. The message is the actor's own; any other failure stays an error."""
    from pipelinerl.actor import Actor
    from pipelinerl.config import load_config
    from pipelinerl.rewards import RewardResult

    cfg = load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=2",
                             "trainer.samples_per_step=2", "actor.dynamic_sampling=true",
                             "actor.max_dropped_in_a_row=2"])
    actor = Actor(cfg, [])
    wrong = RewardResult(0.0, {"correct": 0.0})
    for _ in range(2):
        actor._stream_group([actor._sample("g", [1, 2], [5], [-0.5], [0], "stop", wrong, {}) for _ in range(2)])
    actor.samples.close()
    assert actor.stalled
    log = f"node 0 of 1\npipelinerl: run failed: actor exited with code 1\n2026-11-27 actor ERROR {actor.stalled}\n"
    assert stall_reason(log) == "stalled: dynamic sampling dropped 2 groups in a row"
    assert stall_reason("pipelinerl: run failed: trainer exited with code -9\n") is None
