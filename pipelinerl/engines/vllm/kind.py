"""vLLM behind the contract (this package's front and worker extension) as an engine kind."""

from __future__ import annotations

import importlib.util
import os

from pipelinerl.contracts.engine import EngineKind


def install_problem(gpu: bool) -> str | None:
    from pipelinerl.engines.vllm.launcher import install_advice, installed_vllm

    build, version = installed_vllm()
    advice = install_advice(gpu, build, version)
    if advice is None and importlib.util.find_spec("vllm") is None:
        advice = f"vLLM {version} is installed but its package is missing; reinstall: make install-vllm"
    return advice


def staging_bytes(shape, weight_bytes: int) -> tuple[int, str]:
    """A whole update's page-locked ring beside vLLM, unless it streams (worker_extension)."""
    from pipelinerl.engines.vllm.worker_extension import STAGING_ENV, STAGING_SLACK_BYTES

    staging = shape.num_params * weight_bytes + 2 * shape.largest_tensor * weight_bytes + STAGING_SLACK_BYTES
    return staging, os.environ.get(STAGING_ENV, "auto")


KIND = EngineKind(name="vllm", serve="pipelinerl.engines.vllm:serve", package="vllm", install_problem=install_problem,
                  gpu_memory_flag=("PIPELINERL_VLLM_ARGS", "--gpu-memory-utilization"), tensor_parallel=True,
                  staging_bytes=staging_bytes)
