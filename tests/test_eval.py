"""The evaluation harness: avg@k and pass@k per benchmark and their mean, the table and metrics, the trainer's eval
sampling settings, and real runs through an engine (the CLI on ORZ-format files, the trainer's HeldOutEval)."""

import json
import subprocess
import sys

import pytest
from conftest import running_engine

from pipelinerl.eval import benchmark_names, markdown_table, metrics_row, pass_at_k, summarize, write_results


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 / 4) * (2 / 3))  # 0.5
    assert pass_at_k(4, 2, 4) == 1.0


def test_summary_averages_over_samples_and_problems():
    rows = [{"correct": [1.0, 0.0, 0.0, 0.0]}, {"correct": [1.0, 1.0, 1.0, 1.0]}, {"correct": [0.0] * 4}]
    s = summarize(rows, 4)["summary"]
    assert s["pass@1"] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert s["pass@2"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)


def test_benchmarks_are_scored_apart_and_averaged_unweighted():
    # one easy benchmark of 1 problem, one hard of 3: the mean over benchmarks (ORZ's eval_accuracy) is 0.5,
    # where pooling all problems would say 0.25
    rows = [{"benchmark": "easy", "correct": [1.0, 1.0, 1.0, 1.0], "tokens": [3, 3, 3, 3],
             "truncated": [False] * 4},
            *({"benchmark": "hard", "correct": [0.0, 0.0, 0.0, 1.0 if i == 0 else 0.0], "tokens": [8] * 4,
               "truncated": [True, True, False, False]} for i in range(3))]
    result = summarize(rows, 4)
    easy, hard = result["benchmarks"]
    assert (easy["benchmark"], easy["problems"], easy["k"], easy["avg@4"], easy["pass@4"]) == ("easy", 1, 4, 1.0, 1.0)
    assert (hard["benchmark"], hard["problems"]) == ("hard", 3)
    assert hard["avg@4"] == pytest.approx(1 / 12) and hard["pass@4"] == pytest.approx(1 / 3)
    assert hard["avg@4"] == hard["pass@1"]  # avg@k is pass@1 estimated from k samples
    assert hard["mean_output_tokens"] == 8 and hard["truncated"] == 0.5
    s = result["summary"]
    assert s["problems"] == 4 and s["benchmarks"] == 2
    assert s["avg@4"] == pytest.approx((1.0 + 1 / 12) / 2) and s["pass@4"] == pytest.approx((1.0 + 1 / 3) / 2)

    row = metrics_row(result)
    assert row["eval_accuracy"] == s["avg@4"]
    assert row["eval_easy_avg@4"] == 1.0 and row["eval_hard_avg@4"] == pytest.approx(1 / 12)
    assert row["eval_hard_pass@4"] == pytest.approx(1 / 3) and row["eval_pass@2"] == s["pass@2"]

    table = markdown_table(result).splitlines()
    assert table[0] == "| benchmark | problems | k | avg@4 | pass@4 |"
    assert table[2] == "| easy | 1 | 4 | 1.0000 | 1.0000 |"
    assert table[3] == "| hard | 3 | 4 | 0.0833 | 0.3333 |"
    assert table[4] == f"| mean | 4 | 4 | {(1 + 1 / 12) / 2:.4f} | {(1 + 1 / 3) / 2:.4f} |"


def test_write_results_writes_the_table_and_everything_as_json(tmp_path):
    result = summarize([{"benchmark": "aime2024", "correct": [1.0, 0.0]}], 2)
    result["settings"] = {"k": 2, "temperature": 0.6, "stop": ["</answer>"]}
    json_path, md_path = write_results(result, tmp_path / "eval", "step_000010")
    assert (json_path.name, md_path.name) == ("step_000010.json", "step_000010.md")
    assert json.loads(json_path.read_text())["benchmarks"][0]["avg@2"] == 0.5
    md = md_path.read_text()
    assert "| aime2024 | 1 | 2 | 0.5000 | 1.0000 |" in md and "temperature 0.6" in md and "</answer>" in md


def test_benchmark_names_are_metric_key_safe_and_distinct():
    names = benchmark_names(["aime2024", "HuggingFaceH4/MATH-500", "a/test set", "b/test set"])
    assert names == {"aime2024": "aime2024", "HuggingFaceH4/MATH-500": "MATH-500", "a/test set": "a_test_set",
                     "b/test set": "b_test_set"}


def test_trainer_eval_sampling_is_its_own_with_training_values_as_defaults():
    from pipelinerl.config import load_config
    from pipelinerl.train import HeldOutEval

    base = ["sampling.temperature=1.0", "trainer.temperature=1.0", "sampling.top_p=0.9",
            "sampling.max_new_tokens=24", "sampling.stop=['</answer>','User:']"]
    cfg = load_config("recipes/tiny_cpu.yaml", base)
    assert HeldOutEval.sampling(cfg) == {"temperature": 1.0, "top_p": 0.9, "top_k": cfg.sampling.top_k,
                                         "max_new_tokens": 24, "stop": ["</answer>", "User:"]}
    cfg = load_config("recipes/tiny_cpu.yaml", [*base, "eval.temperature=0.6", "eval.top_p=0.95",
                                                "eval.max_new_tokens=16", "eval.stop=['Human:']"])
    assert HeldOutEval.sampling(cfg) == {"temperature": 0.6, "top_p": 0.95, "top_k": cfg.sampling.top_k,
                                         "max_new_tokens": 16, "stop": ["Human:"]}
    cfg = load_config("recipes/tiny_cpu.yaml", [*base, "eval.stop=[]"])  # explicitly none
    assert HeldOutEval.sampling(cfg)["stop"] == []


@pytest.mark.slow
def test_eval_command_on_orz_format_files(tiny_model_dir, tmp_path):
    data = tmp_path / "tiny_orz.json"
    data.write_text(json.dumps([
        {"prompt": [{"from": "user", "value": "What is 1+1?"}], "final_answer": "2"},
        {"prompt": [{"from": "user", "value": "What is 2+3?"}], "final_answer": "5"},
        {"prompt": [{"from": "user", "value": "Name x if x=7."}], "final_answer": "7"},
    ]))
    other = tmp_path / "other_bench.json"
    other.write_text(json.dumps([{"prompt": [{"from": "user", "value": "What is 4+4?"}], "final_answer": "8"}]))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "eval", "--model", str(tiny_model_dir), "--data",
                        str(data), "--data", str(other), "--template", "boxed", "-k", "3", "--max-new-tokens", "8",
                        "--top-p", "0.9", "--stop", "a", "--stop", "e", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["summary"]["problems"] == 4 and result["summary"]["samples_per_problem"] == 3
    assert [(b["benchmark"], b["problems"]) for b in result["benchmarks"]] == [("tiny_orz", 3), ("other_bench", 1)]
    assert len(result["rows"]) == 4 and all(len(row["correct"]) == 3 for row in result["rows"])
    assert result["settings"]["stop"] == ["a", "e"] and result["settings"]["top_p"] == 0.9
    # a random model writes no \boxed{} answer, so nothing is right, and the table says so
    assert result["summary"]["avg@3"] == 0.0
    md = (out / "eval.md").read_text()
    assert "| tiny_orz | 3 | 3 | 0.0000 | 0.0000 |" in md and "| mean | 4 | 3 | 0.0000 | 0.0000 |" in md


@pytest.mark.slow
def test_trainer_held_out_eval_writes_the_table_and_per_benchmark_metrics(tiny_model_dir, tmp_path):
    from pipelinerl.config import load_config
    from pipelinerl.train import HeldOutEval

    cfg = load_config("recipes/tiny_cpu.yaml", [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                                "task.args.num_eval=6", "trainer.eval_k=3", "eval.max_new_tokens=4",
                                                "eval.stop=['5']"])
    with running_engine(tiny_model_dir, tmp_path) as engine:
        evaluator = HeldOutEval(cfg, [engine.url], enabled=True)
        try:
            row = evaluator.run(20, 1.5, 640)
        finally:
            evaluator.close()
    assert (row["step"], row["time"], row["samples_total"]) == (20, 1.5, 640)
    assert row["eval_accuracy"] == row["eval_arithmetic_avg@3"] and "eval_arithmetic_pass@3" in row
    result = json.loads((tmp_path / "run" / "eval" / "step_000020.json").read_text())
    assert result["settings"]["max_new_tokens"] == 4 and result["settings"]["stop"] == ["5"]
    assert result["settings"]["temperature"] == cfg.sampling.temperature  # eval.temperature unset: training's
    assert all(len(r["correct"]) == 3 and max(r["tokens"]) <= 4 for r in result["rows"])
    assert "| arithmetic | 6 | 3 |" in (tmp_path / "run" / "eval" / "step_000020.md").read_text()


@pytest.mark.slow
def test_eval_command_on_any_task_by_name(tiny_model_dir, tmp_path):
    """`--task` and `--task-args` evaluate any task as a recipe names it, here the tiny code task, whose answers
    run in the sandbox; pass@k is reported beside avg@k. Bad task arguments stop with a message, not a traceback."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "eval", "--model", str(tiny_model_dir), "--task",
                        "pipelinerl.tasks.tiny_code:TinyCodeTask", "--task-args", '{"num_eval": 3, "num_train": 5}',
                        "-k", "2", "--max-new-tokens", "8", "--reward-workers", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "eval.json").read_text())
    assert [(b["benchmark"], b["problems"]) for b in result["benchmarks"]] == [("tiny_code", 3)]
    assert {"avg@2", "pass@1", "pass@2"} <= set(result["summary"])
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "eval", "--model", str(tiny_model_dir), "--task",
                        "pipelinerl.tasks.tiny_code:TinyCodeTask", "--task-args", '{"colour": 1}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--task pipelinerl.tasks.tiny_code:TinyCodeTask" in r.stderr
    assert "colour" in r.stderr and "Traceback" not in r.stderr
