"""A step whose loss or gradients are not finite on one trainer process is skipped on every process: weights,
optimizer state and what the engines hold stay as they were, the skip is counted on every rank, and training goes
on at the next step. Tested for every sharding the recipes use, on two CPU processes over gloo: DeepSpeed ZeRO-3
in bf16 (as recipes/orz_7b.yaml trains), with its optimizer offloaded, FSDP2, and the critic's own optimizer; and
for the case the gradient-norm check alone cannot see, a loss that is inf while its gradients stay finite. After
`trainer.max_skipped_steps` such steps in a row a run stops, saying so (the last test, a whole run).

A NaN let through would turn every rank's weights to NaN and the next broadcast would ship them to the engines.

This file is also the trainer processes' script: the tests launch it with a mode, see `worker` at the end.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import running_engine

from pipelinerl.config import CriticConfig, TrainerConfig, WeightSyncConfig
from pipelinerl.procs import free_port, tail
from pipelinerl.samples import Sample

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

FAULT_RANK_ENV = "NONFINITE_TEST_FAULT_RANK"  # the rank the faults are injected on (the worker reads it)
# the faults, one a step, on one rank only; step 0 and the last step are clean
FAULTS = ["none", "nan_loss", "inf_loss_finite_grads", "none"]
CRITIC_FAULTS = ["none", "critic_inf_loss_finite_grads", "none"]


def cfg(critic: bool, mixed: str) -> TrainerConfig:
    if critic:  # PPO with a critic, ORZ's method (and the critic's own optimizer under the same sharding)
        return TrainerConfig(lr=3e-3, samples_per_step=4, micro_batch_tokens=12, policy_loss="ppo_clip",
                             advantage="gae", critic=CriticConfig(lr=1e-2, updates=1), mixed_precision=mixed)
    return TrainerConfig(lr=3e-3, samples_per_step=4, micro_batch_tokens=12, policy_loss="ppo_clip",
                         mixed_precision=mixed)


def toy_batch(i: int) -> list[Sample]:
    def sample(group: str, prompt: list[int], output: list[int], reward: float) -> Sample:
        return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                      behav_logprobs=[-4.0] * len(output), versions=[0] * len(output), finish_reason="stop",
                      reward=reward)

    return [sample("g0", [5, 6, 7 + i % 3], [10, 11 + i % 5], 1.0), sample("g0", [5, 6, 7 + i % 3], [20, 21, 22], 0.0),
            sample("g1", [8, 9], [30 + i % 4], 0.3), sample("g1", [8, 9], [40, 41], 0.9)]


def launch(mode: str, model_dir: Path, engine_url: str, tmp_path: Path, processes: int = 2) -> list[dict]:
    """Trainer processes running `worker(mode)` (the faults on the last of them); each rank's record. On a
    machine without a GPU they train on the CPU over gloo; with one, `processes=1` trains on GPU 0."""
    script = [str(Path(__file__).resolve()), mode, str(model_dir), engine_url, str(tmp_path)]
    if mode.startswith("zero3"):
        config = "deepspeed_zero3_offload.yaml" if "offload" in mode else "deepspeed_zero3.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{config}",
               "--num_processes", str(processes), "--main_process_port", str(free_port()), *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAULT_RANK_ENV: str(processes - 1),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    log = tmp_path / "trainer.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, f"{mode} trainer exited with {proc.returncode}; log: {log}\n{tail(log, 40)}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    with running_engine(tiny_model_dir, tmp_path / "logs",
                        extra=["--max-model-len", "64", "--max-running-seqs", "8"]) as client:
        yield client


def check_skips(ranks: list[dict], faults: list[str], critic: bool = False) -> None:
    for r, record in enumerate(ranks):
        steps = record["steps"]
        for k, fault in enumerate(faults):
            step = steps[k]
            if fault == "none":
                assert step["skipped"] == 0 and step["shard_changed"], (r, k, step)
            elif fault.startswith("critic"):
                # the policy's update is unaffected; the critic's is skipped, its shard of the weights untouched
                assert step["critic_updates_applied"] == 0 and not step["critic_shard_changed"], (r, k, step)
                assert step["skipped"] == 0 and step["shard_changed"], (r, k, step)
            else:
                assert step["skipped"] == 1 and step["updates_applied"] == 0, (r, k, step)
                assert not step["shard_changed"] and step["version"] == steps[k - 1]["version"], (r, k, step)
            if critic and fault == "none":
                assert step["critic_updates_applied"] == 1 and step["critic_shard_changed"], (r, k, step)
        assert all(map(_finite, record["final_shard_sums"])), f"rank {r} holds non-finite weights"


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def check_engine(ranks: list[dict], faults: list[str], engine) -> None:
    """The engine took a push after every step: after a skipped one it holds exactly what it held before."""
    pushes = ranks[0]["engine_checksums"]
    for k, fault in enumerate(faults):
        if fault != "none" and not fault.startswith("critic"):
            assert pushes[k] == pushes[k - 1], f"the engine's weights changed after skipped step {k}"
        elif k:
            assert pushes[k] != pushes[k - 1], f"the engine's weights did not change after step {k}"
    final = httpx.get(f"{engine.url}/v1/weights/checksum").json()["checksums"]
    assert final == pushes[-1]


@needs_deepspeed
def test_zero3_in_bf16_skips_a_nonfinite_step_on_every_rank(tiny_model_dir, engine, tmp_path):
    ranks = launch("zero3", tiny_model_dir, engine.url, tmp_path)
    assert ranks[0]["is_zero3"] and ranks[0]["dtype"] == "torch.bfloat16"
    check_skips(ranks, FAULTS)
    check_engine(ranks, FAULTS, engine)


@needs_deepspeed
def test_zero3_with_optimizer_offload_skips_a_nonfinite_step(tiny_model_dir, tmp_path):
    ranks = launch("zero3_offload", tiny_model_dir, "", tmp_path)
    assert ranks[0]["is_zero3"]
    check_skips(ranks, FAULTS)


def test_fsdp2_skips_a_nonfinite_step_on_every_rank(tiny_model_dir, engine, tmp_path):
    ranks = launch("fsdp", tiny_model_dir, engine.url, tmp_path)
    check_skips(ranks, FAULTS)
    check_engine(ranks, FAULTS, engine)


@needs_deepspeed
def test_the_critics_optimizer_skips_a_nonfinite_update_under_zero3(tiny_model_dir, tmp_path):
    ranks = launch("zero3_critic", tiny_model_dir, "", tmp_path)
    check_skips(ranks, CRITIC_FAULTS, critic=True)


def test_a_run_stops_after_max_skipped_steps_in_a_row(tmp_path):
    """A loss that is always NaN (a plug-in loss, named by its dotted path): every step is skipped, and after
    trainer.max_skipped_steps of them the run ends, the trainer's log and the launcher naming the cause."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", "recipes/tiny_cpu.yaml",
                           f"run_dir={run_dir}", "model.warmup_steps=0", "trainer.max_steps=50",
                           "trainer.eval_every=0", "trainer.max_skipped_steps=3", "actor.dynamic_sampling=false",
                           "trainer.policy_loss=test_nonfinite_steps:always_nan"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "trainer exited with code 3" in done.stderr
    assert "3 steps in a row had a non-finite (NaN/inf) loss or gradient norm" in done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "skipped" in r]
    assert [r["skipped"] for r in steps] == [1.0, 1.0, 1.0] and {r["step"] for r in steps} == {0}


def always_nan(logprobs, inputs, cfg):
    """A policy loss that is NaN on every token it trains (for the test above)."""
    return torch.where(inputs.mask, logprobs * float("nan"), torch.zeros_like(logprobs)), {}


# ------------------------------------------------------------------------------------------------ the worker


def _shard_digest(model: torch.nn.Module) -> tuple[str, float]:
    """(digest, sum) of this rank's own shard of the weights: ZeRO-3's partitions, FSDP2's local shards."""
    h, total = hashlib.sha256(), 0.0
    for p in model.parameters():
        t = getattr(p, "ds_tensor", None)
        t = t if t is not None else (p.to_local() if hasattr(p, "to_local") else p)
        t = t.detach().float().cpu().contiguous()
        h.update(t.numpy().tobytes())
        total += float(t.sum())
    return h.hexdigest(), total


def _inject(trainer, fault: str, rank: int):
    """Patch this rank's loss for one step to be `fault`; returns the undo."""
    import pipelinerl.trainer.critic as critic_module

    if rank != int(os.environ.get(FAULT_RANK_ENV, "1")) or fault == "none":
        return lambda: None
    if fault.startswith("critic"):
        original = critic_module.value_loss

        def bad_value_loss(*args, **kwargs):
            per_token, clipped = original(*args, **kwargs)
            return per_token + float("inf"), clipped  # a constant: the gradients stay finite

        critic_module.value_loss = bad_value_loss
        return lambda: setattr(critic_module, "value_loss", original)
    original = trainer._micro_batch_loss

    def bad_loss(*args, **kwargs):
        loss, *rest = original(*args, **kwargs)
        if fault == "nan_loss":
            loss = loss * float("nan")
        else:  # inf_loss_finite_grads
            loss = loss + float("inf")
        return (loss, *rest)

    trainer._micro_batch_loss = bad_loss
    return lambda: setattr(trainer, "_micro_batch_loss", original)


def worker(mode: str, model_dir: str, engine_url: str, out: str) -> None:
    from test_trainer_sharded import fsdp_accelerator_on_cpu

    from pipelinerl.trainer import Trainer

    critic = mode.endswith("critic")
    faults = CRITIC_FAULTS if critic else FAULTS
    accelerator = fsdp_accelerator_on_cpu() if mode == "fsdp" else None
    # bf16 under DeepSpeed (the GPU recipes' setting; DeepSpeed's own bf16 path on its CPU accelerator)
    trainer = Trainer(model_dir, cfg(critic, "bf16" if mode.startswith("zero3") else "no"),
                      WeightSyncConfig(timeout_s=60), seed=1, accelerator=accelerator)
    rank = trainer.accelerator.process_index
    group = trainer.connect_engines([engine_url]) if engine_url else None
    steps, checksums = [], []
    for k, fault in enumerate(faults):
        before = _shard_digest(trainer.model)[0]
        critic_before = _shard_digest(trainer.critic.model)[0] if critic else None
        undo = _inject(trainer, fault, rank)
        stats = trainer.optimizer_step(toy_batch(k))
        undo()
        record = {k2: stats[k2] for k2 in ("skipped", "updates_applied", "version", "loss", "grad_norm")}
        record["shard_changed"] = _shard_digest(trainer.model)[0] != before
        if critic:
            record["critic_updates_applied"] = stats["critic_updates_applied"]
            record["critic_shard_changed"] = _shard_digest(trainer.critic.model)[0] != critic_before
        steps.append(record)
        if engine_url:  # every rank: a sharded model is gathered collectively for the push
            trainer.broadcast_weights(group, [engine_url])
            if rank == 0:
                checksums.append(httpx.get(f"{engine_url}/v1/weights/checksum").json()["checksums"])
    result = {"steps": steps, "engine_checksums": checksums, "is_zero3": trainer.is_zero3,
              "dtype": str(next(trainer.model.parameters()).dtype),
              "device": str(trainer.accelerator.device),
              "final_shard_sums": [_shard_digest(trainer.model)[1]]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if group is not None and rank == 0:
        group.destroy()
    trainer.close()


if __name__ == "__main__":
    from pipelinerl.train import exit_now

    worker(*sys.argv[1:])
    exit_now()
