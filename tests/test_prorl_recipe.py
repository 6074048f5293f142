"""recipes/prorl_1p5b.yaml, ProRL's setting: it plans on one node of 8 x 80 GB, and a node without its data is told
which domain's file is missing and where it comes from, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipelinerl.config import load_config
from pipelinerl.launch.preflight import missing_data

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "prorl_1p5b.yaml"


ROOT = RECIPE.parents[1]


def test_prorl_1p5b_plans_on_one_node_of_eight_80_gb_gpus(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "plan", str(RECIPE)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)  # the recipe's configs/accelerate path is the checkout's
    assert r.returncode == 0, r.stderr
    assert "verdict: fits" in r.stdout and "4 x vllm" in r.stdout and "max_model_len 9216" in r.stdout
    cfg = load_config(RECIPE)
    assert cfg.trainer.advantage == "reinforce_pp_baseline" and cfg.trainer.clip_high == 0.4  # the ProRL v2 preset
    assert sorted(cfg.task.args["domains"]) == ["code", "instructions", "logic", "math", "stem"]


def test_each_missing_file_is_named_under_its_domains_key(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(RECIPE, [f"run_dir={tmp_path}/run"])
    problems = missing_data(cfg)
    keys = [p.split(":", 1)[0] for p in problems]
    assert "task.args.domains.stem.args.train_data" in keys and "task.args.domains.instructions.args.eval_data" in keys
    assert any("pipelinerl data orz" in p for p in problems if p.startswith("task.args.domains.math.args.eval_data"))
    assert not any(k.startswith("task.args.domains.logic") for k in keys)  # generated offline: nothing to fetch
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", str(RECIPE), f"run_dir={tmp_path}/run",
                        "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "task.args.domains.code.args.train_data: data/prorl/taco_train.jsonl does not exist" in r.stderr + r.stdout
