"""Decode tokens/s of the embedded engine in bfloat16 against HF `generate` in bfloat16 and in float32, in process,
at batch 1 and 32 (issue 21: would fewer bytes per weight take the engine past 2x HF?).

`python -m bench.engine_bf16 [--sizes 100m,500m]`: engine_scale's models, prompts and measurement (interleaved
rounds, decode tokens/s with the prefill subtracted), one thread, every side loading the same saved float32 model
in the dtype it runs. Writes bench/results/engine_bf16.json. No target: it says whether bfloat16 is a lever, and the
like-for-like ratio is `vs_hf_bf16`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import machine, write_result
from bench.engine_decode import _load
from bench.engine_scale import (
    BATCHES,
    MAX_MODEL_LEN,
    NEW_TOKENS,
    SIZES,
    EngineSide,
    HFSide,
    _ratio,
    build_model,
    make_prompts,
    measure,
)

NAME = "engine_bf16"
ROUNDS = 3


def measure_size(path: Path, size: str) -> list[dict]:
    from transformers import AutoTokenizer

    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

    vocab_below = len(AutoTokenizer.from_pretrained(path))
    hf_bf16, hf_fp32 = _load(path, torch.bfloat16), _load(path, torch.float32)
    engine = EmbeddedEngine(_load(path, torch.bfloat16), str(path),
                            EngineSettings(max_running_seqs=max(BATCHES), max_model_len=MAX_MODEL_LEN))
    rows = []
    try:
        for batch in BATCHES:
            prompts = make_prompts(batch, vocab_below)
            sides = {"engine_bf16": EngineSide(engine, prompts), "hf_bf16": HFSide(hf_bf16, prompts),
                     "hf_fp32": HFSide(hf_fp32, prompts)}
            measured = measure(sides, batch, NEW_TOKENS[size], ROUNDS)
            row = {"size": size, "batch": batch, "new_tokens": NEW_TOKENS[size],
                   "tokens_per_s": {k: round(v, 2) for k, v in measured["tokens_per_s"].items()},
                   "vs_hf_bf16": round(_ratio(measured, "engine_bf16", "hf_bf16"), 3),
                   "vs_hf_fp32": round(_ratio(measured, "engine_bf16", "hf_fp32"), 3),
                   "engine_kernels": engine.runner.linear_kernels}
            print(f"   {size} b{batch}: {row['tokens_per_s']} tok/s; engine bf16 vs HF bf16 {row['vs_hf_bf16']:.2f}x, "
                  f"vs HF fp32 {row['vs_hf_fp32']:.2f}x", flush=True)
            rows.append(row)
    finally:
        engine.shutdown()
    return rows


def run(sizes: list[str]) -> dict:
    torch.set_num_threads(1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            rows += measure_size(build_model(Path(tmp), size), size)
    return {"name": NAME, "rows": rows, "settings": {"threads": 1, "rounds": ROUNDS, "batches": list(BATCHES)},
            "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_bf16", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100m,500m", help=f"comma-separated, of {', '.join(SIZES)}")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    print(f"wrote {write_result(NAME, run(sizes))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
