"""The GPU checks run only where torch sees a CUDA GPU (`make test-gpu`); everywhere else every test in this
directory is skipped with one reason, before any of them starts a process.

Helpers for the tests here: how many GPUs there are, an engine server started on a GPU of its own, a `pipelinerl
run` of a recipe, and a small model whose attention heads every GPU attention kernel takes (64 dims)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from pipelinerl.engines.client import EngineClient
from pipelinerl.placement import gpu_env
from pipelinerl.procs import engine_command, start_process, stop_process, tail, wait_for_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_GPU = "no CUDA GPU (torch.cuda.is_available() is False): these GPU checks run with `make test-gpu` on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    # a skipif, put first: pytest reports the first true skipif of an item, and the tests' own (too few GPUs,
    # no vLLM build) would otherwise speak for a machine that has no GPU at all
    skip = pytest.mark.skipif(True, reason=NO_GPU)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip, append=False)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int, why: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPUs ({why}); this machine has {gpu_count()}")


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with 64-dim attention heads (FlashAttention and vLLM's GPU backends take those) and sharp
    next-token distributions, so greedy decoding rarely meets a tie."""
    from pipelinerl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpu_model"), hidden_size=128, num_layers=2, num_heads=2,
                            num_kv_heads=1, initializer_range=0.2, seed=1234)


@contextlib.contextmanager
def engine_on_gpu(model_dir: Path, log: Path, gpu: int, kind: str = "embedded", extra: Sequence[str] = (),
                  timeout_s: float = 600) -> Iterator[EngineClient]:
    """`pipelinerl serve --engine KIND` on GPU `gpu` alone (as this process numbers them), healthy; stopped on the
    way out. The client has `.process` and `.log_path`."""
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    cmd = engine_command(str(model_dir), 0, engine=kind, extra=[*extra, "--port-file", str(port_file)])
    env = {**gpu_env((gpu,), os.environ.get("CUDA_VISIBLE_DEVICES")),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_process(cmd, log, env=env)
    client = None
    try:
        try:
            client = EngineClient(f"http://127.0.0.1:{wait_for_port(port_file, proc, timeout_s)}")
            client.wait_healthy(timeout_s=timeout_s, process=proc)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- {kind} engine log ---\n{tail(log, 40)}") from e
        client.process, client.log_path = proc, log
        yield client
    finally:
        if client is not None:
            client.close()
        stop_process(proc, timeout_s=30)


def pipelinerl_run(recipe: str, run_dir: Path, *overrides: str, timeout_s: float = 1500) -> subprocess.CompletedProcess:
    """`pipelinerl run RECIPE run_dir=RUN_DIR OVERRIDES` from the repository root, output captured."""
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / recipe), f"run_dir={run_dir}",
           *overrides]
    # dies with this process (a killed test run leaves no trainer or engine holding the GPU)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PIPELINERL_DIE_WITH_PARENT": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
