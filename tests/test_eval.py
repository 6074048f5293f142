"""The evaluation harness: pass@k arithmetic and a real run on an ORZ-format file through an engine."""

import json
import subprocess
import sys

import pytest

from pipelinerl.eval import pass_at_k, summarize


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


@pytest.mark.slow
def test_eval_command_on_an_orz_format_file(tiny_model_dir, tmp_path):
    data = tmp_path / "tiny_orz.json"
    data.write_text(json.dumps([
        {"prompt": [{"from": "user", "value": "What is 1+1?"}], "final_answer": "2"},
        {"prompt": [{"from": "user", "value": "What is 2+3?"}], "final_answer": "5"},
        {"prompt": [{"from": "user", "value": "Name x if x=7."}], "final_answer": "7"},
    ]))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "eval", "--model", str(tiny_model_dir), "--data",
                        str(data), "--template", "boxed", "-k", "3", "--max-new-tokens", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["summary"]["problems"] == 3 and result["summary"]["samples_per_problem"] == 3
    assert len(result["rows"]) == 3 and all(len(row["correct"]) == 3 for row in result["rows"])
    # a random model writes no \boxed{} answer, so nothing is right, and the table says so
    assert result["summary"]["pass@1"] == 0.0
    assert "| pass@1 | 0.0000 |" in (out / "eval.md").read_text()
