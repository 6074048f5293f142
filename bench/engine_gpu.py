"""Decode on one GPU: the embedded engine (in process) against Hugging Face `generate` on the same GPU, at
Qwen2.5-0.5B's shape (engine_scale's "500m": random bfloat16 weights built from the config, nothing downloaded), and
how busy the GPU is while the engine decodes.

Needs a GPU; elsewhere `run` returns a result marked skipped (engine_scale measures the same sides on CPU).

Per batch (BATCHES), both sides decode greedily with EOS ignored; the time of a decode step is
(t(N2) - t(N1)) / (N2 - N1) for two answer lengths, so that the prefill drops out (the better of two runs of each
length). Then `torch.profiler` records the engine decoding at the largest batch: `gpu_busy` is the GPU's kernel
time over the wall time, `kernels_per_step` the kernels launched a decode step. A low `gpu_busy` means the host
(Python, one kernel launch per operation, no CUDA graphs) sets the step, not the GPU.

`ratio` = the smallest engine / HF speed over the batches. Target: >= 2, issue 21's target against HF `generate`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import machine, verdict, write_result
from bench.engine_scale import EngineSide, HFSide, _timed, build_model

NAME = "engine_gpu"
TARGET = 2.0
BATCHES = (1, 32, 128)
LENGTHS = (32, 128)  # new tokens of the two runs whose difference gives the step time
PROFILED_TOKENS = 64


def unavailable() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a GPU (torch.cuda.is_available() is False on this machine); engine_scale measures the CPU"
    return None


def run(quick: bool = False) -> dict:
    reason = unavailable()
    if reason:
        return {"name": NAME, "ratio": None, "target": TARGET, "passed": False, "skipped": reason,
                "summary": f"skipped: {reason}", "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), "500m")
        t0 = time.perf_counter()
        result = measure(path, "cuda", BATCHES[:2] if quick else BATCHES, (16, 48) if quick else LENGTHS)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["machine"] = {**machine(), "gpu": torch.cuda.get_device_name(0)}
    return result


def measure(path: Path, device: str, batches: Sequence[int], lengths: tuple[int, int]) -> dict:
    """The table and the ratio for the model in `path` on `device` (bfloat16 on a GPU, float32 on the CPU)."""
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings
    from pipelinerl.engines.embedded.serve import load_model

    model, tokenizer = load_model(str(path), "bfloat16" if device == "cuda" else "float32", device)
    vocab_below = len(tokenizer) if tokenizer is not None else 256
    engine = EmbeddedEngine(model, str(path), EngineSettings(max_running_seqs=max(batches), max_model_len=512,
                                                             max_batch_tokens=max(batches) * 64))
    rows, opened = [], []
    try:
        for batch in batches:
            prompts = _prompts(batch, vocab_below)
            sides = {"engine": EngineSide(engine, prompts), "hf": HFSide(model, prompts)}
            opened += sides.values()
            ms = {name: _step_ms(side, lengths, device) for name, side in sides.items()}
            rows.append({"batch": batch, "engine_ms": round(ms["engine"], 4), "hf_ms": round(ms["hf"], 4),
                         "engine_over_hf": round(ms["hf"] / ms["engine"], 2)})
        profiled = _gpu_busy(EngineSide(engine, _prompts(max(batches), vocab_below)), device) \
            if device == "cuda" else {}
    finally:
        for side in opened:
            side.close()
        engine.shutdown()
    ratio = min(r["engine_over_hf"] for r in rows)
    table = "\n".join(f"batch {r['batch']:4d}: engine {r['engine_ms']:.2f} ms a step, HF generate "
                      f"{r['hf_ms']:.2f} ms: {r['engine_over_hf']:.2f}x" for r in rows)
    busy = profiled.get("gpu_busy")
    summary = f"engine / HF generate {ratio:.2f}x at worst" + (
        f"; GPU {busy:.0%} busy in the engine's decode, {profiled['kernels_per_step']:.0f} kernels a step"
        if busy is not None else "")
    return {"name": NAME, "rows": rows, "gpu_busy": busy, **profiled, "table": table, "summary": summary,
            "model": "qwen2-500m (Qwen2.5-0.5B's config, random weights)", "device": device, "lengths": lengths,
            **verdict(ratio, TARGET)}


def _prompts(batch: int, vocab_below: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(4, vocab_below, (24,), generator=g).tolist() for _ in range(batch)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _seconds(side: EngineSide | HFSide, new_tokens: int, device: str) -> float:
    """engine_scale's timing of one batch (which checks the tokens generated), the GPU's queue empty before it.
    Both sides end on a host read of their tokens, so no work is left in the queue when the clock stops."""
    _sync(device)
    return _timed(side, new_tokens)


def _step_ms(side: EngineSide | HFSide, lengths: tuple[int, int], device: str) -> float:
    _seconds(side, 4, device)  # warm-up: kernels chosen, caches allocated
    short, long = (min(_seconds(side, n, device) for _ in range(2)) for n in lengths)
    return (long - short) / (lengths[1] - lengths[0]) * 1e3


def _gpu_busy(side: EngineSide, device: str) -> dict:
    """The GPU's kernel time over the wall time of the engine's decode, and the kernels it launches a step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _seconds(side, 8, device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = _seconds(side, PROFILED_TOKENS, device)
    events = prof.key_averages()
    kernels_s = sum(e.self_device_time_total for e in events) / 1e6
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA)
    return {"gpu_busy": round(kernels_s / wall, 3), "kernel_ms_per_step": round(kernels_s / PROFILED_TOKENS * 1e3, 2),
            "kernels_per_step": round(kernels / PROFILED_TOKENS, 1)}


if __name__ == "__main__":
    import json
    import sys

    result = run(quick="--quick" in sys.argv)
    if result.get("skipped"):
        print(f"{NAME}: {result['skipped']}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {write_result(NAME, result)}")
    print(result["table"])
    print(json.dumps({k: result[k] for k in ("ratio", "passed", "summary", "gpu_busy", "seconds")}, indent=1))
