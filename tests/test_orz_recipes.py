"""The Open-Reasoner-Zero recipes: they load, their settings are ORZ's where they say so, the cross-checks that
fail before anything starts, where their processes go, and that a GPU recipe stops at once on this machine."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl import cli
from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch import gpu_memory_args, missing_data, missing_resources
from pipelinerl.placement import NodeEnv, plan_node

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
ORZ_STOPS = ["User:", "Human:", "Assistant:", "</answer>"]


@pytest.mark.parametrize("name", ["orz_7b", "orz_32b", "orz_1gpu"])
def test_gpu_recipes_use_orz_settings(name):
    cfg = load_config(RECIPES / f"{name}.yaml")
    assert cfg.task.args["template"] == "orz" and cfg.task.args["reward"] == "orz_exact"
    assert cfg.sampling.stop == ORZ_STOPS
    # ORZ: lr 1e-6 after 50 warm-up steps, Adam (0.9, 0.95), no weight decay, clip 1, 128 x 64 samples, 8000 tokens
    t = cfg.trainer
    assert (t.lr, t.warmup_steps, t.schedule, t.betas, t.weight_decay, t.grad_clip) == (
        1e-6, 50, "constant", [0.9, 0.95], 0.0, 1.0)
    assert (t.samples_per_step, cfg.sampling.group_size, cfg.sampling.max_new_tokens) == (8192, 64, 8000)
    assert t.kl_coef == 0 and cfg.sampling.temperature == t.temperature == 1.0
    # ORZ's method: PPO-clip 0.2 with a critic (lr 5e-6, 12 updates a batch, value clip 0.2), GAE(1, 1), normalised
    # advantages, one policy update a batch, every group trained on
    assert (t.policy_loss, t.clip_low, t.clip_high, t.advantage, t.ppo_minibatches) == ("ppo_clip", 0.2, 0.2, "gae", 1)
    c = t.critic
    assert (c.lr, c.updates, c.value_clip, c.gamma, c.lam, c.whiten_advantages) == (5e-6, 12, 0.2, 1.0, 1.0, True)
    assert not cfg.actor.dynamic_sampling
    assert cfg.model.dtype == "bfloat16" and cfg.resources.gpus_per_node >= 1
    assert {Path(p).stem for p in cfg.task.args["eval_data"]} == {"aime2024", "aime2025", "math500", "gpqa_diamond"}
    assert t.micro_batch_tokens >= cfg.engine.max_model_len > 2048 + cfg.sampling.max_new_tokens - 1


def test_recipes_place_their_processes():
    cfg = load_config(RECIPES / "orz_7b.yaml")
    plan = plan_node(cfg, NodeEnv(), num_gpus=8)
    assert plan.trainer_gpus == (0, 1, 2, 3) and [e.gpus for e in plan.engines] == [(4,), (5,), (6,), (7,)]
    cfg = load_config(RECIPES / "orz_32b.yaml")
    node0, node1, node2, node3 = (plan_node(cfg, NodeEnv(4, r, "10.0.0.1"), num_gpus=8) for r in range(4))
    # the trainer over nodes 0-1, engines of two GPUs (tensor parallel 2) on nodes 2-3
    assert node0.trainer_gpus == node1.trainer_gpus == tuple(range(8)) and node0.engines == node1.engines == ()
    assert node1.first_trainer_rank == 8 and [e.gpus for e in node3.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # one GPU: the engine shares the trainer's
    cfg = load_config(RECIPES / "orz_1gpu.yaml")
    plan = plan_node(cfg, NodeEnv(), num_gpus=1)
    assert plan.trainer_gpus == (0,) and [e.gpus for e in plan.engines] == [(0,)]
    assert gpu_memory_args(cfg.engine) == {"PIPELINERL_VLLM_ARGS": "--gpu-memory-utilization 0.35"}


@pytest.mark.parametrize("overrides, key", [
    (["trainer.micro_batch_tokens=8192"], "trainer.micro_batch_tokens"),  # below engine.max_model_len 10240
    (["sampling.temperature=0.7"], "sampling.temperature"),  # the trainer scores at 1.0
    (["weight_sync.backend=gloo"], "weight_sync.backend"),  # a GPU recipe with the CPU backend
])
def test_cross_checks_name_the_keys(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(RECIPES / "orz_7b.yaml", overrides)
    if "temperature" in key:  # both keys are named
        assert "trainer.temperature" in str(e.value)


def test_colocated_engines_need_gloo():
    with pytest.raises(ConfigError, match="weight_sync.backend.*same GPU"):
        load_config(RECIPES / "orz_1gpu.yaml", ["weight_sync.backend=nccl"])


def test_missing_resources_and_data_are_said_before_anything_starts(tmp_path):
    cfg = load_config(RECIPES / "orz_7b.yaml", [f"run_dir={tmp_path}/run"])
    problems = missing_resources(cfg, "recipes/orz_7b.yaml", NodeEnv(), gpus=0)
    assert len(problems) == 1 and "8 GPUs" in problems[0] and "pipelinerl plan recipes/orz_7b.yaml" in problems[0]
    assert missing_resources(cfg, "r", NodeEnv(), gpus=8) == []
    cfg32 = load_config(RECIPES / "orz_32b.yaml")
    assert any("WORLD_SIZE=1" in p and "sbatch --nodes 4" in p for p in missing_resources(cfg32, "r", NodeEnv(), 8))
    data = missing_data(load_config(RECIPES / "orz_7b.yaml", [
        "task.args.train_data=[/nonexistent/orz_math_57k_collected.json]", "task.args.eval_data=[]"]))
    assert len(data) == 1 and "task.args.train_data" in data[0] and "/nonexistent" in data[0]
    hub = load_config(RECIPES / "orz_7b.yaml", ["task.args.train_data=[HuggingFaceH4/MATH-500:test]",
                                                "task.args.eval_data=[]"])
    assert missing_data(hub) == []  # a hub name is not a missing file


def test_a_gpu_recipe_stops_within_seconds_on_a_cpu_machine(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", str(RECIPES / "orz_7b.yaml"),
                        f"run_dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "8 GPUs" in r.stderr and "pipelinerl plan" in r.stderr and "data orz" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written
    assert time.monotonic() - start < 60  # seconds, not a model load (generous: a loaded 2-core machine)



@pytest.mark.parametrize("recipe, extra, gib, sequences", [
    ("orz_7b", [], "67.1 GiB each", "99 sequences"),
    ("orz_32b", [], "82.5 GiB each", "74 sequences"),
    ("orz_32b", ["--gpu-memory", "80", "trainer.micro_batch_tokens=10240"], "76.4 GiB each", "30 sequences"),
    ("orz_1gpu", [], "37.2 GiB in all", "113 sequences"),
])
def test_docs_orz_table_holds_the_plans_numbers(capsys, recipe, extra, gib, sequences):
    """docs/orz.md's hardware column quotes `pipelinerl plan`: a change to a recipe or to the memory model that moves
    a number fails here, so the page a GPU user sizes a cluster by stays current."""
    row = next(line for line in (ROOT / "docs" / "orz.md").read_text().splitlines()
               if line.startswith("|") and f"recipes/{recipe}.yaml" in line)
    assert gib in row and sequences in row, row
    assert cli.main(["plan", f"recipes/{recipe}.yaml", *extra, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"], plan["problems"]
    need = plan["gpus"][0]["need_bytes"]  # node 0, GPU 0: trainer rank 0 (with the engine where they share it)
    assert f"{need / 2**30:.1f}" == gib.split()[0]
    assert plan["engine"]["sequences"] == int(sequences.split()[0])
