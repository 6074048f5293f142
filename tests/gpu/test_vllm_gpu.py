"""vLLM on GPUs: updates over NCCL received into GPU memory while vLLM generates, and a tensor-parallel engine.

Each test skips without the GPUs it needs or without vLLM's GPU build. The trainer (this process, rank 0) keeps its
tensors on GPU 0 and the engine runs on GPUs of its own: NCCL takes one GPU per member of a group.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelinerl.conformance import Reference, mismatch
from pipelinerl.engines.client import EngineClient, init_group_on_engines, push_weights
from pipelinerl.engines.vllm.launcher import install_advice, installed_vllm
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail
from pipelinerl.weight_sync import init_weight_update_group

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ATOL = 1e-2  # float32 on both sides, but GPU kernels (vLLM's attention, cuBLAS) sum in other orders than the CPU


def _vllm_problem() -> str | None:
    if not GPUS:
        return "needs a GPU"
    return install_advice(True, *installed_vllm())


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_vllm_problem() is not None, reason=str(_vllm_problem()))]


def _visible(gpus: list[int]) -> str:
    listed = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(listed[g] if g < len(listed) else str(g) for g in gpus)


@contextlib.contextmanager
def vllm_on(model: Path, gpus: list[int], log: Path, staging: str = "auto"):
    """`pipelinerl serve --engine vllm` on `gpus` (tensor parallel over all of them), healthy."""
    port = free_port()
    cmd = engine_command(str(model), port, engine="vllm",
                         extra=["--max-model-len", "512", "--max-running-seqs", "4",
                                "--tensor-parallel-size", str(len(gpus))])
    env = {"CUDA_VISIBLE_DEVICES": _visible(gpus), "PIPELINERL_VLLM_STAGING": staging,
           "PIPELINERL_VLLM_ARGS": "--gpu-memory-utilization 0.5",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_process(cmd, log, env=env)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        try:
            client.wait_healthy(timeout_s=900, process=proc)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- vLLM log ---\n{tail(log, 40)}") from e
        yield client
    finally:
        client.close()
        stop_process(proc, timeout_s=60)


def _model(tmp_path: Path) -> Path:
    return build_tiny_model(tmp_path / "model", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                            initializer_range=0.2, seed=99)


def _update_in_flight(client: EngineClient, group, ref: Reference, new: dict, prompt: list[int], steps: int,
                      log: Path, device: str) -> None:
    """An update pushed during a long greedy generation switches it once, mid-way, to the new weights continuing
    from the KV cache computed before the switch. The trainer sends copies on `device` (NCCL sends from GPU
    memory); the rescoring uses the reference's own."""
    version = client.info().weight_version
    old = ref.base
    send_new = [(n, t.to(device)) for n, t in ref.named(new)]
    send_old = [(n, t.to(device)) for n, t in ref.named(old)]

    def greedy(n: int):
        return client.generate(prompt, temperature=0, max_new_tokens=n, ignore_eos=True).completions[0]

    t0 = time.perf_counter()
    greedy(steps)
    delay, landed = 0.35 * (time.perf_counter() - t0), []
    for _ in range(5):
        out: dict = {}
        thread = threading.Thread(target=lambda into=out: into.update(c=greedy(steps)))
        thread.start()
        time.sleep(delay)
        push_weights(group, [client], send_new, version + 1, bucket_bytes=1 << 20)
        thread.join(300)
        c = out["c"]
        switch = c.versions.index(version + 1) if version + 1 in c.versions else steps
        landed.append(switch)
        if 0 < switch < steps - 10:
            break
        delay *= 2.0 if switch == 0 else 0.4
        push_weights(group, [client], send_old, version + 2)
        version += 2
    assert 0 < switch < steps - 10, f"no update landed inside the generation: {landed}\n{tail(log, 30)}"
    assert c.versions == [version] * switch + [version + 1] * (steps - switch)
    problem = mismatch(c, ref.logits_switched(old, new, prompt, c.token_ids, switch), 0, ATOL)
    assert problem is None, f"switch at token {switch}: {problem}"


def _join(client: EngineClient, backend: str, ranks_per_engine: int):
    if backend == "nccl":
        torch.cuda.set_device(0)
    port = free_port()
    world, futures = init_group_on_engines([client], "127.0.0.1", port, backend, "gpu-test", 120,
                                           ranks_per_engine=ranks_per_engine)
    group = init_weight_update_group("127.0.0.1", port, 0, world, backend, "gpu-test", 120)
    for f in futures:
        f.result()
    return group


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU for the trainer and another for the engine")
@pytest.mark.parametrize("staging", ["gpu", "cpu", "stream"])
def test_nccl_update_while_generating_is_exact(tmp_path, staging):
    """Over NCCL, staged on the engine's GPU (received in place), in page-locked host memory, or streamed into the
    weights while generation pauses (what an update too large to stage on the GPU gets): the update lands between
    two steps of a running generation, and pushing the original weights back gives the original generation again,
    bit for bit."""
    model = _model(tmp_path)
    ref = Reference(str(model))
    new = ref.perturbed(seed=2)
    prompt = [5, 6, 67, 7, 8, 71]
    log = tmp_path / "vllm.log"
    with vllm_on(model, [GPUS - 1], log, staging) as client:
        group = _join(client, "nccl", 1)
        try:
            before = client.generate(prompt, temperature=0, max_new_tokens=64, ignore_eos=True).completions[0]
            _update_in_flight(client, group, ref, new, prompt, 300, log, "cuda:0")
            after = client.generate(prompt, temperature=0, max_new_tokens=64, ignore_eos=True).completions[0]
            assert mismatch(after, ref.logits(new, prompt, after.token_ids), 0, ATOL) is None
            base = [(n, t.cuda()) for n, t in ref.named(ref.base)]
            push_weights(group, [client], base, client.info().weight_version + 1, bucket_bytes=1 << 20)
            again = client.generate(prompt, temperature=0, max_new_tokens=64, ignore_eos=True).completions[0]
            assert (again.token_ids, again.logprobs) == (before.token_ids, before.logprobs)
        finally:
            group.destroy()
    staged = [line for line in log.read_text().splitlines() if "staging weight updates" in line]
    if staging == "stream":
        assert not staged and "streamed weight update failed" not in log.read_text(), staged
    else:
        assert staged and all(("GiB on cuda" in line) == (staging == "gpu") for line in staged), staged


@pytest.mark.skipif(GPUS < 2, reason="tensor parallel 2 needs two GPUs for the engine")
def test_tensor_parallel_engine_loads_its_shards(tmp_path):
    """Tensor parallel 2 over the engine's GPUs: each worker is a rank of the group, receives every tensor whole and
    loads its shard. With a third GPU the trainer sends over NCCL from it; with two, over gloo from host memory."""
    model = _model(tmp_path)
    ref = Reference(str(model))
    new = ref.perturbed(seed=3)
    prompt = [9, 10, 11, 12]
    backend = "nccl" if GPUS >= 3 else "gloo"
    log = tmp_path / "vllm.log"
    with vllm_on(model, [GPUS - 2, GPUS - 1], log) as client:
        group = _join(client, backend, 2)
        try:
            _update_in_flight(client, group, ref, new, prompt, 300, log, "cuda:0" if backend == "nccl" else "cpu")
            after = client.generate(prompt, temperature=0, max_new_tokens=64, ignore_eos=True).completions[0]
            assert mismatch(after, ref.logits(new, prompt, after.token_ids), 0, ATOL) is None
        finally:
            group.destroy()

