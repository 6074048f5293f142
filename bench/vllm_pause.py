"""How long generation stops for each weight update on a vLLM engine on a GPU, and how long the whole update takes.

Needs a GPU and vLLM's GPU build; elsewhere `run` returns a result marked skipped and `python -m bench.vllm_pause`
exits with a message saying so (status 2).

This process is the trainer: rank 0 of the weight-update group with one `pipelinerl serve --engine vllm` on a GPU
of its own, serving a model with the published shape of a Qwen2.5 model (MODELS; random bfloat16 weights built
from the config, nothing downloaded). CONCURRENT client threads keep vLLM decoding long sampled requests while
the trainer pushes UPDATES updates (after one warm-up update, which allocates the engine's staging buffers), in
BUCKET_BYTES buckets as a run sends them. Per update:
- pause: how long generation stood still for it, the front's `switch_s` (vLLM paused between two steps, the
  staged weights loaded with `reload_weights`, the version relabelled, vLLM resumed);
- update: the trainer's wall time from posting the update to the engine's answer (the broadcast, received while
  vLLM decodes, plus the pause).
With two GPUs or more the group is NCCL (trainer tensors on GPU 0, the engine on the last GPU) and each model is
measured twice, the update staged on the engine's GPU (`PIPELINERL_VLLM_STAGING=gpu`, received in place, GPU to
GPU at the switch) and in page-locked host memory (`cpu`: one host to GPU copy at the switch); with one GPU the
group is gloo (trainer tensors in host memory), which stages in host memory. vLLM gets the share of its GPU that
leaves room for the staged update (`--gpu-memory-utilization`).

`ratio` = median update time / median pause for the largest model measured, staged as `auto` would stage it on
that GPU (on the GPU where it fits): how many times longer an update takes than the stop it causes; the rest of
the update overlaps decoding. Target: >= 5. With both stagings measured, `pause_host_over_gpu` is the pause of
host staging over that of GPU staging.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import machine, median, verdict, write_result

NAME = "vllm_pause"
TARGET = 5.0
MODELS = ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B")  # the published shapes (pipelinerl.plan.QWEN25_CONFIGS)
QUICK_MODELS = ("Qwen/Qwen2.5-0.5B",)
UPDATES, QUICK_UPDATES = 5, 2
BUCKET_BYTES = 512 * 2**20  # recipes/orz_7b.yaml's weight_sync.bucket_mb
CONCURRENT, PROMPT_LEN, MAX_NEW = 32, 64, 1024
MAX_MODEL_LEN = 2048
ENGINE_SHARE = 0.9  # vLLM's share of its GPU when nothing else needs room on it (engine.gpu_memory_utilization)
ROOT = Path(__file__).resolve().parents[1]


def unavailable() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a GPU (torch.cuda.is_available() is False on this machine)"
    from pipelinerl.engines.vllm.launcher import install_advice, installed_vllm

    build, version = installed_vllm()
    return install_advice(True, build, version)


def run(quick: bool = False) -> dict:
    """Every model and staging this machine's GPUs allow; returns the JSON-able result."""
    reason = unavailable()
    if reason:
        return {"name": NAME, "ratio": None, "target": TARGET, "passed": False, "skipped": reason,
                "summary": f"skipped: {reason}", "machine": machine()}
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    stagings = ("gpu", "cpu") if backend == "nccl" else ("cpu",)
    engine_gpu = gpus - 1
    updates = QUICK_UPDATES if quick else UPDATES
    runs = []
    with tempfile.TemporaryDirectory(prefix="vllm_pause_") as tmp:
        for name in QUICK_MODELS if quick else MODELS:
            path, weights = _build_model(name, Path(tmp), "cuda:0" if backend == "nccl" else "cpu")
            for staging in stagings:
                runs.append(_measure(name, path, weights, backend, staging, engine_gpu, updates, Path(tmp)))
            del weights
            torch.cuda.empty_cache()
    return _result(runs, backend, gpus, updates)


def _build_model(name: str, root: Path, device: str) -> tuple[Path, list[tuple[str, torch.Tensor]]]:
    """A random bfloat16 model of the published shape `name`, saved under `root` with the char tokenizer, and its
    parameters (the trainer's copy, on `device`)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pipelinerl.models.tiny import build_char_tokenizer
    from pipelinerl.plan import QWEN25_CONFIGS

    shape = QWEN25_CONFIGS[name]
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                         num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                         tie_word_embeddings=shape["tie_word_embeddings"], max_position_embeddings=MAX_MODEL_LEN,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    path = root / name.split("/")[-1]
    torch.manual_seed(0)
    with torch.device("cuda:0"):  # random init on the GPU: minutes faster than on the host for 7B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    weights = [(n, p.detach().to(device)) for n, p in model.named_parameters()]  # deduplicated, like the trainer
    del model
    torch.cuda.empty_cache()
    return path, weights


def _engine_share(update_bytes: int, largest_bytes: int, staging: str, gpu: int) -> float:
    """vLLM's `--gpu-memory-utilization` on its GPU: the default share, less the room the staged update takes
    when it is staged there (what a run's engine.gpu_memory_utilization must leave too)."""
    from pipelinerl.engines.vllm.worker_extension import STAGING_SLACK_BYTES

    if staging != "gpu":
        return ENGINE_SHARE
    total = torch.cuda.get_device_properties(gpu).total_memory
    return round(min(ENGINE_SHARE, 0.97 - (update_bytes + 2 * largest_bytes + STAGING_SLACK_BYTES) / total), 3)


def _visible(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's GPU `gpu`."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[gpu] if gpu < len(visible) else str(gpu)


def _measure(name: str, path: Path, weights: list[tuple[str, torch.Tensor]], backend: str, staging: str,
             engine_gpu: int, updates: int, log_dir: Path) -> dict:
    """Start vLLM for `path` on `engine_gpu`, keep it decoding, push `updates` updates; per-update timings."""
    from pipelinerl.engines.client import EngineClient, init_group_on_engines, push_weights
    from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail
    from pipelinerl.weight_sync import init_weight_update_group

    update_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    largest = max(t.numel() * t.element_size() for _, t in weights)
    share = _engine_share(update_bytes, largest, staging, engine_gpu)
    port = free_port()
    log = log_dir / f"{path.name}-{staging}.log"
    extra = ["--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--max-running-seqs", str(CONCURRENT)]
    env = {"CUDA_VISIBLE_DEVICES": _visible(engine_gpu), "PIPELINERL_VLLM_STAGING": staging,
           "PIPELINERL_VLLM_ARGS": f"--gpu-memory-utilization {share}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_process(engine_command(str(path), port, engine="vllm", extra=extra), log, env=env)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=1800)
    group = load = None
    try:
        try:
            client.wait_healthy(timeout_s=1200, process=proc)
        except Exception as e:
            raise RuntimeError(f"vLLM for {name}: {e}\n--- log ---\n{tail(log, 40)}") from e
        if backend == "nccl":
            torch.cuda.set_device(0)
        group_port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", group_port, backend, "vllm_pause", 300)
        group = init_weight_update_group("127.0.0.1", group_port, 0, world, backend, "vllm_pause", 300)
        for f in futures:
            f.result()
        version = client.info().weight_version
        load = _Load(client)
        load.wait_running()
        pushes = []
        for i in range(updates + 1):  # the first allocates the staging buffers: not counted
            start = time.perf_counter()
            resp = push_weights(group, [client], weights, version + 1 + i, BUCKET_BYTES)[0]
            wall = time.perf_counter() - start
            if i:
                pushes.append({"update_s": round(wall, 4), "pause_s": round(resp.switch_s, 4),
                               "receive_s": round(resp.receive_s, 4)})
        running = client.metrics().get("pipelinerl_running_seqs")
        staged_on = _staged_on(log)
    finally:
        if load is not None:
            load.stop()
        if group is not None:
            group.destroy()
        client.close()
        stop_process(proc, timeout_s=60)
    pause, update = median([p["pause_s"] for p in pushes]), median([p["update_s"] for p in pushes])
    return {"model": name, "staging": staging, "staged_on": staged_on, "update_bytes": update_bytes,
            "gpu_memory_utilization": share, "pause_s_median": round(pause, 4),
            "update_s_median": round(update, 4), "update_over_pause": round(update / pause, 2),
            "receive_gib_per_s": round(update_bytes / median([p["receive_s"] for p in pushes]) / 2**30, 2),
            "running_seqs_at_end": running, "load_errors": load.errors[:5], "pushes": pushes}


def _staged_on(log: Path) -> str | None:
    """Where the engine's worker says it staged the update (worker_extension logs it once per layout)."""
    for line in log.read_text(errors="replace").splitlines():
        if "staging weight updates of" in line:
            return line.split("staging weight updates of", 1)[1].strip()
    return None


class _Load:
    """CONCURRENT threads posting long sampled requests one after another, so vLLM decodes during updates."""

    def __init__(self, client):
        self.client, self.stopping, self.errors = client, threading.Event(), []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CONCURRENT)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        prompt = [4 + (i * 7 + j) % 90 for j in range(PROMPT_LEN)]  # within the char tokenizer's ids
        while not self.stopping.is_set():
            try:
                self.client.generate(prompt, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True)
            except Exception as e:  # reported in the result
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                time.sleep(0.5)

    def wait_running(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.client.metrics().get("pipelinerl_running_seqs", 0) < CONCURRENT // 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM never ran {CONCURRENT // 2} of the load's sequences at once")
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopping.set()
        try:
            self.client.abort()
        except Exception:
            pass
        for t in self.threads:
            t.join(timeout=60)


def _result(runs: list[dict], backend: str, gpus: int, updates: int) -> dict:
    largest = [r for r in runs if r["model"] == runs[-1]["model"]]
    # what `auto` would pick: GPU staging when it was measured (it fits: the run gave vLLM the room)
    main = next((r for r in largest if r["staging"] == "gpu"), largest[0])
    ratio = main["update_over_pause"]
    by_staging = {r["staging"]: r for r in largest}
    host_over_gpu = (round(by_staging["cpu"]["pause_s_median"] / by_staging["gpu"]["pause_s_median"], 2)
                     if {"cpu", "gpu"} <= set(by_staging) else None)
    return {
        "name": NAME,
        **verdict(ratio, TARGET),
        "ratio_is": "median update time / median generation pause per update, largest model, staged as auto "
                    "stages it",
        "summary": (f"{main['model']} ({main['update_bytes'] / 2**30:.1f} GiB, {main['staging']} staging, "
                    f"{backend}): pause {main['pause_s_median'] * 1e3:.0f} ms per update of "
                    f"{main['update_s_median']:.2f} s"
                    + (f"; host staging pauses {host_over_gpu}x longer" if host_over_gpu else "")),
        "pause_host_over_gpu": host_over_gpu,
        "runs": runs,
        "settings": {"backend": backend, "gpus": gpus, "updates_per_run": updates, "bucket_bytes": BUCKET_BYTES,
                     "concurrent_requests": CONCURRENT, "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW,
                     "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16", "vllm": _vllm_version()},
        "machine": {**machine(), "gpu": torch.cuda.get_device_name(0)},
    }


def _vllm_version() -> str | None:
    from pipelinerl.engines.vllm.launcher import installed_vllm

    return installed_vllm()[1]


def main() -> int:
    reason = unavailable()
    if reason:
        print(f"bench/vllm_pause.py: {reason}; nothing measured", file=sys.stderr)
        return 2
    result = run(quick="--quick" in sys.argv[1:])
    print(f"{result['summary']}\nwrote {write_result(NAME, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
