"""SGLang behind the contract (this package's front) as an engine kind."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from pipelinerl.contracts.engine import EngineKind

if TYPE_CHECKING:
    from pipelinerl.config import RunConfig

UPDATE_CHUNK_ENV = "PIPELINERL_SGLANG_UPDATE_CHUNK_MB"


def install_problem(gpu: bool) -> str | None:
    if not gpu:
        return "SGLang runs on GPUs only (it has no CPU build); use engine.kind embedded or vllm here"
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "engine.kind sglang needs SGLang, which is not installed: make install-sglang"
    return None


def launch_env(cfg: RunConfig) -> dict[str, str]:
    # the most one weight-update call to SGLang takes (front.py)
    return {UPDATE_CHUNK_ENV: str(cfg.weight_sync.sglang_update_chunk_mb)}


def check_config(cfg: RunConfig) -> None:
    """What SGLang's weight-update path cannot take (front.py)."""
    from pipelinerl.config import _check

    w, e = cfg.weight_sync, cfg.engine
    _check(w.bucket_mb == 0, "weight_sync.bucket_mb",
           f"{w.bucket_mb:g}, but SGLang (engine.kind sglang) receives one broadcast per tensor; set "
           "weight_sync.bucket_mb=0 or leave it unset")
    _check(cfg.resources.gpus_per_node > 0, "engine.kind",
           "sglang runs on GPUs only (it has no CPU build): set resources.gpus_per_node, or use engine.kind "
           "embedded or vllm on CPU")
    _check(not e.colocate_with_trainer, "engine.colocate_with_trainer",
           "SGLang cannot share the trainer's GPUs: its updates go over nccl, which refuses two ranks of one "
           "group on one GPU; give the engines GPUs of their own")
    _check(w.backend in ("nccl", "auto"), "weight_sync.backend",
           f"{w.backend!r}, but SGLang receives updates into GPU memory and is supported over nccl only; set "
           "weight_sync.backend=nccl or auto")


KIND = EngineKind(name="sglang", serve="pipelinerl.engines.sglang:serve", package="sglang",
                  install_problem=install_problem, gpu_memory_flag=("PIPELINERL_SGLANG_ARGS", "--mem-fraction-static"),
                  tensor_parallel=True, default_bucket_mb=0.0, launch_env=launch_env, check_config=check_config)
