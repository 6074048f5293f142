import json

import pytest

from pipelinerl.plot import benchmark_keys, generated_accuracy, panels_with_data, plot_runs, read_metrics


def test_plot_writes_pngs_for_several_runs(tmp_path):
    for name, slope in (("a", 0.1), ("b", 0.2)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": i, "time": 2.0 * i, "reward_mean": slope * i, "kl": 0.01 * i, "lag_mean": 1}
                for i in range(10)]
        rows.insert(3, {"step": 3, "time": 6.0, "eval_accuracy": 0.5})
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    paths = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert [p.name for p in paths] == ["curves_step.png", "curves_time.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plot_of_a_non_run_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory"):
        plot_runs([tmp_path])


def test_per_benchmark_eval_gets_a_png_of_its_own(tmp_path):
    rows = [{"step": i, "time": 2.0 * i, "reward_mean": 0.1 * i} for i in range(1, 21)]
    for step in (0, 10, 20):
        rows.append({"step": step, "time": 2.0 * step, "eval_accuracy": 0.02 * step, "eval_pass@16": 0.05 * step,
                     "eval_aime2024_avg@16": 0.01 * step, "eval_math500_avg@16": 0.03 * step,
                     "eval_gpqa_diamond_avg@16": 0.02 * step, "eval_gpqa_diamond_pass@16": 0.04 * step})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert benchmark_keys(rows) == {"aime2024": "eval_aime2024_avg@16", "math500": "eval_math500_avg@16",
                                    "gpqa_diamond": "eval_gpqa_diamond_avg@16"}
    paths = plot_runs([tmp_path])
    assert [p.name for p in paths] == ["curves_step.png", "curves_time.png", "eval_benchmarks.png"]
    png = paths[-1].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_accuracy_of_all_answers_generated_comes_from_the_actors_counters(tmp_path):
    """Under dynamic sampling the trained batch holds only groups with a right and a wrong answer, so its reward
    says little about the policy; the actor's cumulative counters give the accuracy of every answer, per window
    of at least min_samples answers, and start again where a resumed actor's counters do."""
    counters = [(0, 0, 0), (1, 100, 10), (2, 300, 40), (3, 500, 100), (4, 560, 130),  # first actor
                (4, 0, 0), (5, 250, 150)]  # resumed: its counters begin again
    rows = [{"time": 5.0 * i, "trainer_version": v, "samples_generated": n, "samples_generated_correct": c}
            for i, (v, n, c) in enumerate(counters)]
    (tmp_path / "actor_metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    windows = generated_accuracy(tmp_path, min_samples=200)
    assert [(w["step"], w["time"], w["generated_accuracy"]) for w in windows] == [
        (2, 10.0, 40 / 300), (3, 15.0, 60 / 200), (5, 30.0, 150 / 250)]
    assert generated_accuracy(tmp_path / "nowhere") == []

    # plot_runs draws it as a panel of its own beside the trained batch's reward
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "time": 2.0 * i, "reward_mean": 0.5})
                                                      for i in range(1, 6)) + "\n")
    runs = {"run": read_metrics(tmp_path) + windows}
    titles = [title for title, _ in panels_with_data(runs)]
    assert titles[:2] == ["reward (trained batch)", "accuracy of all answers generated"]
    assert plot_runs([tmp_path])[0].stat().st_size > 5000


def test_a_run_with_domains_gets_a_png_of_each_domains_training_numbers(tmp_path):
    from pipelinerl.plot import plot_domains

    rows = [{"step": i, "time": 2.0 * i, "reward_mean": 0.1 * i,
             "domain_add_accuracy": 0.05 * i, "domain_add_lag_mean": 1.0, "domain_add_output_tokens_mean": 4,
             "domain_ifeval_accuracy": 0.02 * i, "domain_ifeval_truncated_frac": 0.1, "domain_ifeval_lag_mean": 2.0}
            for i in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    paths = plot_runs([tmp_path])
    assert [p.name for p in paths] == ["curves_step.png", "curves_time.png", "domains.png"]
    png = paths[-1].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert plot_domains({"x": [{"step": 1, "reward_mean": 0.1}]}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
