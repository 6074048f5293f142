"""The trainer sharded over two CPU processes (gloo): DeepSpeed ZeRO-3 launched as on GPUs (`accelerate launch`
with `configs/accelerate/deepspeed_zero3.yaml`), and FSDP2. Each trains a few steps, gathers the full parameters
(`Trainer.full_parameters`, the sharded code paths) and broadcasts them to a real engine; the gathered weights
must match an unsharded trainer that saw the same batches, and the engine must hold them bit for bit.

This file is also the trainer processes' script: the test launches it with a mode, see `worker` at the end.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import running_engine
from safetensors.torch import load_file

from pipelinerl.config import CriticConfig, TrainerConfig, WeightSyncConfig
from pipelinerl.engines.embedded.engine import tensor_checksums
from pipelinerl.procs import free_port, tail
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer, checkpoint_dir, export_hf, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3

pytestmark = pytest.mark.slow


def trainer_cfg() -> TrainerConfig:
    """Decoupled PPO and a KL reference reset every 2 versions: the proximal pass, the reference model (loaded
    whole beside a ZeRO-3 policy) and `reset_reference` (gathering on all ranks) all run."""
    return TrainerConfig(lr=3e-3, weight_decay=0.1, warmup_steps=2, schedule="cosine", max_steps=6,
                         samples_per_step=4, micro_batch_tokens=12, kl_coef=0.05, ref_reset_every=2,
                         policy_loss="decoupled_ppo", temperature=0.7)


def critic_cfg() -> TrainerConfig:
    """PPO with a critic (ORZ's method, as recipes/orz_7b.yaml runs it under ZeRO-3). One critic update a step:
    with more, each rank splits its own share of the batch, so the updates see other subsets than one process's."""
    return TrainerConfig(lr=3e-3, samples_per_step=4, micro_batch_tokens=12, policy_loss="ppo_clip",
                         advantage="gae", critic=CriticConfig(lr=1e-2, updates=1))


def sample(group: str, prompt: list[int], output: list[int], reward: float, version: int = 0) -> Sample:
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                  behav_logprobs=[-4.0] * len(output), versions=[version] * len(output), finish_reason="stop",
                  reward=reward)


def toy_batch(i: int) -> list[Sample]:
    """Two groups of four samples of different lengths (each rank trains on its share); varies with `i`."""
    return [sample("g0", [5, 6, 7 + i % 3], [10, 11 + i % 5], 1.0, version=i // 2),
            sample("g0", [5, 6, 7 + i % 3], [20, 21, 22, 23, 24, 25], 0.0, version=i // 2),
            sample("g1", [8, 9], [30 + i % 4], 0.3, version=i // 2),
            sample("g1", [8, 9], [40, 41], 0.9, version=max(0, i // 2 - 1))]


# ------------------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def unsharded(tiny_model_dir):
    """What one process with the whole model makes of the same batches: full parameters and per-step stats."""
    trainer = Trainer(str(tiny_model_dir), trainer_cfg(), seed=1)
    stats = [trainer.optimizer_step(toy_batch(i)) for i in range(STEPS)]
    return {n: t.clone() for n, t in trainer.full_parameters()}, stats


def run_sharded(mode: str, model_dir: Path, engine_url: str, tmp_path: Path) -> dict:
    out = tmp_path / "sharded.pt"
    script = [str(Path(__file__).resolve()), mode, str(model_dir), engine_url, str(out)]
    if mode.startswith(("deepspeed", "memory-deepspeed", "critic-deepspeed")):
        config = {"deepspeed": "deepspeed_zero3.yaml", "deepspeed_offload": "deepspeed_zero3_offload.yaml",
                  "memory-deepspeed": "deepspeed_zero3.yaml", "critic-deepspeed": "deepspeed_zero3.yaml"}[mode]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               f"configs/accelerate/{config}", "--num_processes", "2", "--main_process_port",
               str(free_port()), *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "trainer.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, f"{mode} trainer exited with {proc.returncode}; log: {log}\n{tail(log)}"
    return torch.load(out)


def check_against_unsharded(got: dict, unsharded, engine) -> None:
    expected, expected_stats = unsharded
    assert got["world"] == 2
    assert got["local_numel"] < got["full_numel"], "each rank should hold only a shard of the parameters"
    params = got["params"]
    assert params.keys() == expected.keys()
    for name in expected:
        assert params[name].dtype == expected[name].dtype and params[name].shape == expected[name].shape, name
        # Not bit for bit: the sharded run sums gradients over ranks in another order (differences ~1e-6).
        # A key bias's true gradient is zero (softmax ignores a constant shift of the scores), so what Adam
        # moves it by is normalised rounding noise, different in each run: it can only be bounded by the lr.
        atol = STEPS * trainer_cfg().lr if name.endswith("k_proj.bias") else 2e-5
        torch.testing.assert_close(params[name], expected[name], atol=atol, rtol=0, msg=name)
    for got_step, want_step in zip(got["stats"], expected_stats, strict=True):
        for key in ("loss", "kl", "grad_norm", "tokens", "samples", "micro_batches", "version", "ref_reset"):
            # the gradient norm sums float32 squares in another order than one process's (and MKL may thread the
            # unsharded run's products differently under load): 1.06e-5 apart was seen once under `make test`
            rel = 1e-4 if key == "grad_norm" else 1e-5
            assert got_step[key] == pytest.approx(want_step[key], rel=rel, abs=1e-6), key
    # the reference was reset to the gathered policy after step 2, so step 3's KL is zero again
    assert [s["ref_reset"] for s in got["stats"]] == [0, 1, 0]
    assert got["stats"][1]["kl"] > 0 and got["stats"][2]["kl"] == pytest.approx(0.0, abs=1e-6)

    # the export is the gathered weights; going back to the checkpoint and redoing a step is exact
    exported = load_file(Path(got["export"]) / "model.safetensors")
    assert exported.keys() == params.keys() and all(torch.equal(exported[n], params[n]) for n in params)
    assert_equal_params(got["restored"], params)
    (next_stats, next_params), (resumed_stats, resumed_params) = got["next"], got["resumed"]
    assert_equal_params(resumed_params, next_params)
    assert resumed_stats["version"] == next_stats["version"] == STEPS + 1
    for key in ("loss", "kl", "grad_norm", "lr"):
        assert resumed_stats[key] == next_stats[key], key

    # the engine holds exactly what rank 0 gathered and broadcast
    state = httpx.get(f"{engine.url}/v1/weights/checksum").json()
    local = tensor_checksums(params)
    assert state["version"] == got["broadcast_version"] == STEPS
    assert {n: state["checksums"][n] for n in local} == local
    assert engine.info().weight_version == STEPS


def assert_equal_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    with running_engine(tiny_model_dir, tmp_path / "logs",
                        extra=["--max-model-len", "64", "--max-running-seqs", "8"]) as client:
        yield client


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install deepspeed; the `gpu` extra has it)")
def test_deepspeed_zero3_on_cpu_matches_unsharded_and_reaches_engine(tiny_model_dir, engine, unsharded, tmp_path):
    got = run_sharded("deepspeed", tiny_model_dir, engine.url, tmp_path)
    assert got["distributed_type"] == "DEEPSPEED" and got["is_zero3"]
    check_against_unsharded(got, unsharded, engine)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install deepspeed; the `gpu` extra has it)")
def test_deepspeed_zero3_optimizer_offload_matches_unsharded(tiny_model_dir, engine, unsharded, tmp_path):
    """configs/accelerate/deepspeed_zero3_offload.yaml (what `pipelinerl plan` suggests when the optimizer state
    does not fit): DeepSpeed takes the trainer's torch AdamW over the offloaded state, and training is the same."""
    got = run_sharded("deepspeed_offload", tiny_model_dir, engine.url, tmp_path)
    assert got["distributed_type"] == "DEEPSPEED" and got["is_zero3"] and got["offload_optimizer"]
    check_against_unsharded(got, unsharded, engine)


def test_fsdp2_on_cpu_matches_unsharded_and_reaches_engine(tiny_model_dir, engine, unsharded, tmp_path):
    got = run_sharded("fsdp", tiny_model_dir, engine.url, tmp_path)
    assert got["distributed_type"] == "FSDP"
    check_against_unsharded(got, unsharded, engine)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install deepspeed; the `gpu` extra has it)")
def test_ppo_with_a_critic_under_deepspeed_zero3_matches_unsharded(tiny_model_dir, tmp_path):
    """The critic is prepared as a second DeepSpeed engine beside the policy's, sharded the same way: its stats
    match one process's, and a checkpoint brings both models back exactly."""
    got = run_sharded("critic-deepspeed", tiny_model_dir, "", tmp_path)
    assert got["is_zero3"] and got["critic_local_numel"] < got["critic_full_numel"]
    trainer = Trainer(str(tiny_model_dir), critic_cfg(), seed=1)
    want = [trainer.optimizer_step(toy_batch(i)) for i in range(STEPS)]
    for got_step, want_step in zip(got["stats"], want, strict=True):
        for key in ("loss", "grad_norm", "critic_loss", "critic_explained_var", "critic_grad_norm", "adv_std"):
            assert got_step[key] == pytest.approx(want_step[key], rel=1e-4, abs=1e-6), key
    assert got["stats"][-1]["critic_updates_applied"] == 1
    for key in ("loss", "grad_norm", "critic_loss", "critic_grad_norm"):
        assert got["resumed"][key] == got["next"][key], key


# A model of 126 MB in float32 (8 layers of hidden 512, no tensor above 4 MB) broadcast in 4 MB buckets.
MEMORY_BUCKET_MB = 4


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from pipelinerl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide_model"), hidden_size=512, num_layers=8, seed=3)


@pytest.mark.parametrize("mode", ["deepspeed", "fsdp"])
def test_sharded_broadcast_takes_about_one_bucket_beyond_the_sharded_state(mode, wide_model_dir, tmp_path):
    """The memory a broadcast adds to each trainer rank, measured: its resident set sampled every millisecond
    while `broadcast_weights` runs, against just before. Gathering one bucket at a time, packing into two
    reused buffers, the main rank may add a few buckets, far less than the 126 MB model; the old way (the whole
    model gathered, then sent) added all of it."""
    if mode == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    with running_engine(wide_model_dir, tmp_path, extra=["--max-model-len", "64", "--max-running-seqs", "2"]) as e:
        got = run_sharded(f"memory-{mode}", wide_model_dir, e.url, tmp_path)
        assert e.info().weight_version == 3  # three optimizer steps, the last two broadcast
    bucket = MEMORY_BUCKET_MB * 2**20
    assert got["full_bytes"] > 100 * 2**20 and got["largest_tensor"] <= bucket
    bound = 4 * bucket + 24 * 2**20  # gathered bucket + the gather's own buffer + two packing buffers + slack
    for rank, extra in enumerate(got["extra"]):
        assert extra <= bound, (f"rank {rank}: a broadcast added {extra / 2**20:.1f} MB, more than "
                                f"{bound / 2**20:.0f} MB (model {got['full_bytes'] / 2**20:.0f} MB)")
    print(f"{mode}: extra memory per rank during a broadcast {[round(x / 2**20, 1) for x in got['extra']]} MB "
          f"(model {got['full_bytes'] / 2**20:.0f} MB, bucket {MEMORY_BUCKET_MB} MB)")


# ------------------------------------------------------------------------------- the trainer processes' side


def fsdp_accelerator_on_cpu():
    """An accelerator set up as an FSDP2 launch sets it up on GPUs, but on CPU processes (gloo).

    accelerate (1.x) selects FSDP only for GPU-like devices, so on CPU this test states it itself: FSDP2 and
    the full state dict gather run on CPU/gloo, accelerate just never picks them there. Both the process-wide
    and the accelerator-wide state say FSDP, as accelerate's own selection would leave them.
    """
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)  # MULTI_CPU under torchrun: the gloo process group
    assert accelerator.num_processes == 2, "run under torchrun with two processes"
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT")  # as configs/accelerate/fsdp.yaml
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank stores of parameter `p` (a ZeRO-3 partition, an FSDP2 DTensor shard, or all)."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
    if hasattr(p, "to_local"):
        return p.to_local().numel()
    return p.numel()


class PeakMemory:
    """The peak resident set of this process above where it started, sampled every millisecond on a thread
    (glibc told to return freed blocks of 128 kB and more to the system at once, so frees show)."""

    def __init__(self):
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def memory_worker(mode: str, model_dir: str, engine_url: str, out: str) -> None:
    """Two broadcasts (the first sizes the group's buffers), each measured; one process's numbers per file."""
    import gc

    import torch.distributed as dist

    accelerator = fsdp_accelerator_on_cpu() if mode == "fsdp" else None
    sync = WeightSyncConfig(timeout_s=120, bucket_mb=MEMORY_BUCKET_MB)
    trainer = Trainer(model_dir, TrainerConfig(lr=1e-4), sync, seed=1, accelerator=accelerator)
    trainer.optimizer_step(toy_batch(0))  # the optimizer state exists, as in a run
    group = trainer.connect_engines([engine_url])
    extra = []
    for _ in range(2):
        trainer.optimizer_step(toy_batch(1))
        gc.collect()
        dist.barrier()
        with PeakMemory() as memory:
            trainer.broadcast_weights(group, [engine_url])
        extra.append(memory.extra)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, max(extra))
    if trainer.accelerator.is_main_process:
        specs = trainer.publisher.specs
        torch.save({"extra": everyone, "full_bytes": sum(s.nbytes for s in specs),
                    "largest_tensor": max(s.nbytes for s in specs)}, out)
        group.destroy()
    trainer.close()


def worker(mode: str, model_dir: str, engine_url: str, out: str) -> None:
    if mode.startswith("memory-"):
        memory_worker(mode.removeprefix("memory-"), model_dir, engine_url, out)
        return
    if mode.startswith("critic-"):
        critic_worker(model_dir, out)
        return
    accelerator = fsdp_accelerator_on_cpu() if mode == "fsdp" else None  # deepspeed: make_accelerator's own
    trainer = Trainer(model_dir, trainer_cfg(), WeightSyncConfig(timeout_s=60), seed=1, accelerator=accelerator)
    stats = [trainer.optimizer_step(toy_batch(i)) for i in range(STEPS)]
    group = trainer.connect_engines([engine_url])
    broadcast = trainer.broadcast_weights(group, [engine_url])
    params = gathered(trainer)
    shards = [local_numel(p) for p in trainer.model.parameters()]

    # export and a checkpoint in the sharded layout; then one more step, twice: straight on, and after
    # going back to the checkpoint
    work = Path(out).parent
    export_hf(trainer, work / "export")
    save_checkpoint(trainer, checkpoint_dir(work, STEPS), {"next_batch": STEPS})
    next_stats = trainer.optimizer_step(toy_batch(STEPS))
    next_params = gathered(trainer)
    position = load_checkpoint(trainer, checkpoint_dir(work, STEPS))
    restored = gathered(trainer)
    resumed_stats = trainer.optimizer_step(toy_batch(position["next_batch"]))
    resumed_params = gathered(trainer)

    if trainer.accelerator.is_main_process:
        torch.save({"params": params, "stats": stats, "broadcast_version": broadcast.version,
                    "world": trainer.accelerator.num_processes, "is_zero3": trainer.is_zero3,
                    "offload_optimizer": _offloads_optimizer(trainer),
                    "distributed_type": trainer.accelerator.distributed_type.name,
                    "local_numel": sum(shards), "full_numel": sum(t.numel() for t in params.values()),
                    "export": str(work / "export"), "restored": restored, "next": (next_stats, next_params),
                    "resumed": (resumed_stats, resumed_params)}, out)
        group.destroy()
    trainer.close()


def critic_worker(model_dir: str, out: str) -> None:
    """PPO with a critic under ZeRO-3: STEPS steps, a checkpoint, one more step, then back to the checkpoint and
    that step again."""
    trainer = Trainer(model_dir, critic_cfg(), seed=1)
    stats = [trainer.optimizer_step(toy_batch(i)) for i in range(STEPS)]
    work = Path(out).parent
    save_checkpoint(trainer, checkpoint_dir(work, STEPS))
    next_stats = trainer.optimizer_step(toy_batch(STEPS))
    load_checkpoint(trainer, checkpoint_dir(work, STEPS))
    resumed_stats = trainer.optimizer_step(toy_batch(STEPS))
    critic_shards = sum(local_numel(p) for p in trainer.critic.model.parameters())
    critic_full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.critic.model.parameters())
    if trainer.accelerator.is_main_process:
        torch.save({"stats": stats, "next": next_stats, "resumed": resumed_stats, "is_zero3": trainer.is_zero3,
                    "critic_local_numel": critic_shards, "critic_full_numel": critic_full}, out)
    trainer.close()


def _offloads_optimizer(trainer: Trainer) -> bool:
    if not trainer.is_deepspeed:
        return False
    zero = trainer.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
    return (zero.get("offload_optimizer") or {}).get("device") == "cpu"


def gathered(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full parameters (collective when sharded; empty except on the main process)."""
    return {n: t.clone() for n, t in trainer.full_parameters()}


if __name__ == "__main__":
    from pipelinerl.train import exit_now

    worker(*sys.argv[1:])
    exit_now()  # as the trainer role does: no interpreter teardown once the work is saved
