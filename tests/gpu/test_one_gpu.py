"""Checks that one GPU is enough for: the embedded engine on a GPU against the inference contract (the conformance
suite, this process as its trainer over gloo), the ZeRO-3 trainer path of the 7B/32B recipes (DeepSpeed on
CUDA, the parameters gathered bucket by bucket and pushed into an engine on the same GPU), and that path with
their method, PPO with a critic."""

from __future__ import annotations

import json

import pytest

from pipelinerl.conformance import FAIL, Settings, format_table, run_suite
from pipelinerl.tasks.synthetic_math import write_synthetic_orz

from .conftest import engine_on_gpu, needs_gpus, pipelinerl_run
from .test_gpu_runs import finished, resolved

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), needs_gpus(1, "an engine or a trainer on a GPU")]


def test_embedded_engine_on_a_gpu_passes_the_conformance_suite(gpu_model_dir, tmp_path):
    """float32 on the GPU, so its log-probs can be held to the suite's CPU rescoring; the tolerance is the GPU
    vLLM tests' (cuBLAS and the attention kernels sum in other orders than the CPU)."""
    extra = ["--dtype", "float32", "--max-model-len", "1024", "--max-running-seqs", "8"]
    with engine_on_gpu(gpu_model_dir, tmp_path / "engine.log", gpu=0, extra=extra) as client:
        results = run_suite(client.url, str(gpu_model_dir), settings=Settings(atol=1e-2), log=print)
    print(format_table(results))
    assert not [r for r in results if r.status == FAIL], format_table(results)


def test_zero3_trainer_of_one_process_on_a_gpu_pushes_to_an_engine(tmp_path):
    """`configs/accelerate/deepspeed_zero3.yaml` with one process: DeepSpeed's ZeRO-3 engine on CUDA in bfloat16,
    its gathered parameters pushed over gloo into the engine beside it on GPU 0, every step."""
    run_dir = tmp_path / "run"
    steps = 5
    result = pipelinerl_run("tiny_cpu.yaml", run_dir, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                            "trainer.num_processes=1",
                            "trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml",
                            "engine.colocate_with_trainer=true")
    finished(result, run_dir, steps)
    assert "trainer on GPUs 0" in result.stdout, result.stdout
    cfg = resolved(run_dir)
    assert cfg["model"]["dtype"] == "bfloat16" and cfg["weight_sync"]["backend"] == "gloo"
    # DeepSpeed wrote its ZeRO partition into the final checkpoint (accelerate's save_state)
    shards = {p.name for p in (run_dir / "checkpoints").rglob("*zero_pp_rank_*")}
    assert any("zero_pp_rank_0_" in name for name in shards), f"no ZeRO partition saved: {shards}"


def test_ppo_with_a_critic_under_zero3_on_one_gpu(tmp_path):
    """The 7B/32B recipes' trainer at tiny scale: `recipes/orz_cpu.yaml`'s ORZ-format problems and model with ORZ's
    method (PPO-clip, a critic trained 12 times a batch, GAE), DeepSpeed ZeRO-3 over both models, bfloat16 and
    gradient checkpointing, pushing to an engine beside it on GPU 0."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    write_synthetic_orz(data)
    steps, updates = 5, 12
    result = pipelinerl_run("orz_cpu.yaml", run_dir, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                            f"task.args.train_data=[{data}/train.json]", f"task.args.eval_data=[{data}/eval/add.json]",
                            "trainer.advantage=gae", f"trainer.critic.updates={updates}", "trainer.critic.lr=1e-4",
                            "trainer.gradient_checkpointing=true", "actor.dynamic_sampling=false",
                            "trainer.num_processes=1",
                            "trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml",
                            "engine.colocate_with_trainer=true")
    rows = [r for r in finished(result, run_dir, steps) if "eval_accuracy" not in r]
    assert resolved(run_dir)["model"]["dtype"] == "bfloat16"
    for row in rows:
        assert row["critic_updates_applied"] == updates, json.dumps(row)
        assert 0 < row["critic_loss"] < 1 and row["updates_applied"] == 1, json.dumps(row)
    # the critic learns (at the CPU rehearsal's lr 1e-4; ORZ's 5e-6 is for a 7B critic): its head starts at zero,
    # where its loss is that of zero values, half the mean squared return; by the last step its values have moved
    # towards the returns and the loss is well under that
    zero_value_loss = [0.5 * (r["critic_returns_var"] + r["critic_returns_mean"] ** 2) for r in rows]
    assert rows[-1]["critic_loss"] < 0.9 * zero_value_loss[-1], [(r["critic_loss"], z) for r, z in
                                                                  zip(rows, zero_value_loss)]


def test_a_nonfinite_step_under_zero3_in_bf16_on_a_gpu_is_skipped(gpu_model_dir, tmp_path):
    """tests/test_nonfinite_steps.py's ZeRO-3 check on CUDA: one trainer process (DeepSpeed's bf16 path on a GPU),
    a NaN loss at step 1 and an inf loss with finite gradients at step 2, each skipped with the weights and what the
    engine beside it holds unchanged."""
    from test_nonfinite_steps import FAULTS, check_engine, check_skips, launch

    with engine_on_gpu(gpu_model_dir, tmp_path / "engine.log", gpu=0,
                       extra=["--max-model-len", "64", "--max-running-seqs", "8"]) as engine:
        ranks = launch("zero3", gpu_model_dir, engine.url, tmp_path, processes=1)
        assert ranks[0]["is_zero3"] and ranks[0]["dtype"] == "torch.bfloat16" and ranks[0]["device"] == "cuda:0"
        check_skips(ranks, FAULTS)
        check_engine(ranks, FAULTS, engine)
