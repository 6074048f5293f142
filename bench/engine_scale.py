"""Decode tokens/s of the embedded engine at 20M, 100M and 494M parameters, against Hugging Face `generate` and
against vLLM's CPU build, at batch 1 and 32 (issue 21).

Models: Qwen2 architecture, random weights, built from a config and saved with the char tokenizer (nothing
downloaded), float32, tied embeddings, heads of 64 dims, 2 KV heads (SIZES):
- 20m: hidden 256, 12 layers, 4 heads, intermediate 1024, vocab 32768 (20.2M parameters);
- 100m: hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32768 (98.3M);
- 500m: Qwen2.5-0.5B's config: hidden 896, 24 layers, 14 heads, intermediate 4864, vocab 151936 (494.0M).
The vocabularies are larger than the tokenizer's ~100 tokens: prompts are random ids below the tokenizer's size
(16-32 of them, lengths drawn per prompt), and generated ids past it are fine on every side.

Sides, each with THREADS torch/OpenMP thread:
- `engine`: an `EmbeddedEngine` in this process, the batch submitted together on one event loop;
- `hf`: `model.generate` on the batch left-padded to its longest prompt (with its attention mask), greedy,
  `min_new_tokens` = `max_new_tokens` so EOS cannot end it;
- `engine_http` and `vllm`: `pipelinerl serve --engine embedded|vllm` servers (vLLM at `--dtype float32`, what
  the front passes by default), the batch posted concurrently to the contract's /v1/generate, greedy,
  `ignore_eos`. These two are the like-for-like comparison with vLLM (same front, same client); not in `--quick`,
  and `vllm` only where vLLM imports. They are measured first, the servers then stopped, and the two in-process
  sides after them (so that no more than two sides hold the model at a time).

What is measured: decode tokens/s, B x (N - 1) / (T(N) - T(1)), where T(n) is the wall time of one batch of B
requests of n new tokens, submission to last answer: T(1) is the batch's prefill and first token (and the
front's and client's fixed costs), measured PREFILL_RUNS times per side after a warm-up batch, the median kept;
T(N) is measured in ROUNDS interleaved rounds (each round one run of every side, so that the machine's changing
speed hits them alike). At 494M parameters a batch of 32 prompts is ~800 prompt tokens, whose
prefill takes longer than the decoding of NEW_TOKENS: without the subtraction the ratio would mostly compare
prefills. `e2e_tokens_per_s` (B x N / T(N)) is reported too. Ratios are the median over rounds of each round's
own ratio: `vs_hf` = engine / hf, `vs_vllm` = engine_http / vllm (decode). Why the ratios are what they are: each
row carries the share of the engine's decode step spent in the linear layers' matmul kernels (`decode_profile`; HF's
`generate` runs torch's BLAS kernels, the engine the faster of BLAS and oneDNN for each weight shape, so where that
share is high only faster kernels or fewer bytes can widen the gap) and, at batch 1, the memory roofline: one
thread's measured read bandwidth over the float32 weights' bytes, the most tokens/s any engine reading every weight
once per token could decode (`add_roofline`), and at every batch the compute roofline: one thread's measured float32
matmul FLOP/s (the best large square product, of torch's BLAS and oneDNN; on AMD CPUs MKL runs AVX2 code and oneDNN
can be twice as fast) over the 2 x parameters FLOPs a token's linear layers take, the most tokens/s any engine doing
those multiply-adds in float32 could decode (`add_compute_roofline`). Targets (issue 21): vs_hf >= 2 and vs_vllm >=
1 in every cell; `ratio` (the headline) is the smallest vs_hf, `passed` needs both targets everywhere.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import machine, median, model_settings, write_result
from bench.engine_decode import _load
from bench.engine_vs_vllm import Server, _batch, _vllm_missing, _vllm_version

NAME = "engine_scale"
TARGET_VS_HF, TARGET_VS_VLLM = 2.0, 1.0
THREADS = 1
_QWEN2 = dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
              max_position_embeddings=32768)
SIZES = {
    "20m": dict(hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024,
                vocab_size=32768, **_QWEN2),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048,
                 vocab_size=32768, **_QWEN2),
    "500m": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864,
                 vocab_size=151936, **_QWEN2),  # Qwen2.5-0.5B
}
BATCHES = (1, 32)
PROMPT_LENS = (16, 32)  # each prompt's length drawn from this range, inclusive
NEW_TOKENS = {"20m": 64, "100m": 64, "500m": 16}  # fewer at 494M: a full run stays near 15 minutes on 2 cores
QUICK_NEW_TOKENS = 32
ROUNDS, QUICK_ROUNDS = 3, 3
PREFILL_RUNS = 2
MAX_MODEL_LEN = PROMPT_LENS[1] + max(NEW_TOKENS.values())


def run(quick: bool = False) -> dict:
    """Every size in SIZES (only 20m, in process, with `quick`); returns the JSON-able result."""
    torch.set_num_threads(THREADS)
    vllm_reason = "not run with --quick" if quick else _vllm_missing()
    bandwidth = read_bandwidth()
    peaks = matmul_peak()
    peak = max(peaks.values())
    sizes = ["20m"] if quick else list(SIZES)
    rows: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            path = build_model(Path(tmp), size)
            new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS[size]
            rows += measure_size(path, size, new_tokens, QUICK_ROUNDS if quick else ROUNDS, servers=not quick,
                                 vllm=vllm_reason is None, log_dir=Path(tmp))
    for r in rows:
        if r["batch"] == 1:
            add_roofline(r, bandwidth)
        add_compute_roofline(r, peak)
        # the most any engine could be over HF here: the lower roofline over HF's tokens/s
        lowest = min(r.get("roofline_tokens_per_s", float("inf")), r["compute_roofline_tokens_per_s"])
        r["vs_hf_ceiling"] = round(lowest / r["tokens_per_s"]["hf"], 2)
    vs_hf = [r["vs_hf"] for r in rows]
    vs_vllm = [r["vs_vllm"] for r in rows if "vs_vllm" in r]
    ratio = min(vs_hf)
    passed = ratio >= TARGET_VS_HF and (not vs_vllm or min(vs_vllm) >= TARGET_VS_VLLM)
    return {
        "name": NAME,
        "ratio": round(ratio, 3), "target": TARGET_VS_HF, "passed": bool(passed),
        "ratio_is": "the smallest engine / HF generate decode tokens/s ratio over sizes and batches; passed needs "
                    f">= {TARGET_VS_HF} there and engine_http / vLLM >= {TARGET_VS_VLLM} in every cell",
        "summary": "; ".join(f"{r['size']} b{r['batch']}: {r['vs_hf']:.2f}x HF"
                             + (f", {r['vs_vllm']:.2f}x vLLM" if "vs_vllm" in r else "") for r in rows),
        "vllm_ratio_min": round(min(vs_vllm), 3) if vs_vllm else None,
        "vllm_skipped": vllm_reason,
        "rows": rows,
        "table": table(rows),
        "settings": {"threads": THREADS, "batches": list(BATCHES), "prompt_lens": list(PROMPT_LENS),
                     "new_tokens": {s: QUICK_NEW_TOKENS if quick else NEW_TOKENS[s] for s in sizes},
                     "rounds": QUICK_ROUNDS if quick else ROUNDS, "prefill_runs": PREFILL_RUNS,
                     "dtype": "float32", "sampling": "greedy, EOS ignored", "vllm": _vllm_version(),
                     "statistic": "decode tokens/s = B x (N - 1) / (T(N) - median T(1)); ratios: median over "
                                  "interleaved rounds of each round's ratio"},
        "read_gb_per_s": round(bandwidth / 1e9, 2),
        "matmul_gflop_per_s": round(peak / 1e9, 1),
        "matmul_gflop_per_s_by_kernel": {k: round(v / 1e9, 1) for k, v in peaks.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }


def build_model(root: Path, size: str) -> Path:
    """A random Qwen2 model of SIZES[size] with the char tokenizer, saved under `root`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl.models.tiny import build_char_tokenizer

    path = root / f"qwen2-{size}"
    if (path / "config.json").exists():
        return path
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**SIZES[size], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_prompts(batch: int, vocab_below: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(PROMPT_LENS[0], PROMPT_LENS[1] + 1, (batch,), generator=g).tolist()
    return [torch.randint(4, vocab_below, (n,), generator=g).tolist() for n in lengths]


def measure_size(path: Path, size: str, new_tokens: int, rounds: int, servers: bool, vllm: bool,
                 log_dir: Path) -> list[dict]:
    """Both batches on one model, in two phases that never hold the model more than twice over (at 494M
    parameters each side holds 2-6 GB): the two servers (each started once: vLLM takes ~1 min), then the
    in-process engine and HF."""
    from transformers import AutoTokenizer

    vocab_below = len(AutoTokenizer.from_pretrained(path))
    prompts = {batch: make_prompts(batch, vocab_below) for batch in BATCHES}
    rows = {batch: {"size": size, "batch": batch, "new_tokens": new_tokens,
                    "prompt_tokens": sum(len(p) for p in prompts[batch]), "tokens_per_s": {},
                    "e2e_tokens_per_s": {}, "first_token_seconds": {}, "wall_seconds": {},
                    "load_average_1m": {}} for batch in BATCHES}
    if servers:
        # one after the other: the embedded engine times its matmul kernels as it starts (linear_kernels.py's
        # LinearKernels), which vLLM's start-up beside it would disturb (a server started beside vLLM's decoded
        # 100M-parameter batches of 32 at 0.63x the speed of one started alone, once)
        started = {}
        try:
            for kind in ("embedded", "vllm") if vllm else ("embedded",):
                started[kind] = Server(kind, path, log_dir, max_running_seqs=max(BATCHES),
                                       max_model_len=MAX_MODEL_LEN, threads=THREADS, wait_s=900)
                started[kind].wait()
            for batch in BATCHES:
                sides = {"engine_http": HttpSide(started["embedded"].client.url, prompts[batch])}
                if "vllm" in started:
                    sides["vllm"] = HttpSide(started["vllm"].client.url, prompts[batch])
                measured = measure(sides, batch, new_tokens, rounds)
                _merge(rows[batch], measured, "servers")
                if "vllm" in sides:
                    rows[batch]["vs_vllm"] = _ratio(measured, "engine_http", "vllm")
                    rows[batch]["vs_vllm_rounds"] = _rounds(measured, "engine_http", "vllm")
                _report(rows[batch])
        finally:
            for s in started.values():
                s.stop()
        if "vllm" in started:
            for row in rows.values():
                row["vllm_dtype"] = started["vllm"].logged_dtype()
    hf = _load(path)
    engine = _in_process_engine(path)
    try:
        for batch in BATCHES:
            sides = {"engine": EngineSide(engine, prompts[batch]), "hf": HFSide(hf, prompts[batch])}
            measured = measure(sides, batch, new_tokens, rounds)
            _merge(rows[batch], measured, "in_process")
            rows[batch].update(vs_hf=_ratio(measured, "engine", "hf"), vs_hf_rounds=_rounds(measured, "engine", "hf"),
                               params=sum(p.numel() for p in hf.parameters()), **model_settings(path),
                               engine_kernels=engine.runner.linear_kernels)
            _report(rows[batch])
    finally:
        engine.shutdown()
    del engine
    for batch, profile in decode_profile(hf, BATCHES).items():
        rows[batch]["engine_decode_profile"] = profile
    return [rows[batch] for batch in BATCHES]


LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise")


def decode_profile(model: torch.nn.Module, batches: Sequence[int], steps: int = 10,
                   position: int = 24) -> dict[int, dict]:
    """Where the engine's decode step goes, per batch size: the step's wall time, the share of its operators'
    time spent in the linear layers' matmul kernels (torch.profiler, self CPU time of LINEAR_OPS) and the
    operators per step. A runner of its own on `model` (the engine's is stopped by then), `steps` profiled steps
    after 3 unprofiled ones, every sequence at `position`."""
    from pipelinerl.engines.embedded.slot_runner import SlotRunner

    runner = SlotRunner(model, max(batches), MAX_MODEL_LEN)
    out = {}
    for batch in batches:
        ids, positions = torch.full((batch,), 5), torch.full((batch,), position)
        runner.prefill_batch(list(range(batch)), [[5] * position] * batch)
        for _ in range(3):
            runner.decode(ids, positions, (position, position))
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.decode(ids, positions, (position, position))
        seconds = time.perf_counter() - t0
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS)
        out[batch] = {"step_ms_profiled": round(seconds / steps * 1e3, 2),
                      "linear_share": round(linear / total, 3),
                      "ops_per_step": round(sum(e.count for e in events) / steps)}
    return out


def _merge(row: dict, measured: dict, phase: str) -> None:
    for key in ("tokens_per_s", "e2e_tokens_per_s", "first_token_seconds", "wall_seconds"):
        row[key].update(measured[key])
    row["load_average_1m"][phase] = round(os.getloadavg()[0], 2)


def _report(row: dict) -> None:
    print(f"   {row['size']} b{row['batch']}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["tokens_per_s"].items())
          + " tok/s" + (f"; vs HF {row['vs_hf']:.2f}x" if "vs_hf" in row else "")
          + (f"; vs vLLM {row['vs_vllm']:.2f}x" if "vs_vllm" in row else ""), flush=True)


def measure(sides: dict, batch: int, new_tokens: int, rounds: int) -> dict:
    """A warm-up batch of 2 tokens on every side, T(1) of every side (PREFILL_RUNS each, interleaved), then
    `rounds` interleaved rounds of T(new_tokens). Returns tokens/s and the seconds of each run and side, with
    `decode_seconds` (each round's T(new_tokens) - median T(1)) for the ratios."""
    for side in sides.values():
        _timed(side, 2)
    first: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(PREFILL_RUNS):
        for name, side in sides.items():
            first[name].append(_timed(side, 1))
    full: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            full[name].append(_timed(side, new_tokens))
    t1 = {name: median(ts) for name, ts in first.items()}
    decode = {name: [max(t - t1[name], 1e-9) for t in ts] for name, ts in full.items()}
    return {"tokens_per_s": {name: round(batch * (new_tokens - 1) / median(ts), 2) for name, ts in decode.items()},
            "e2e_tokens_per_s": {name: round(batch * new_tokens / median(ts), 2) for name, ts in full.items()},
            "first_token_seconds": {name: [round(t, 3) for t in ts] for name, ts in first.items()},
            "wall_seconds": {name: [round(t, 3) for t in ts] for name, ts in full.items()},
            "decode_seconds": decode}


def _ratio(measured: dict, fast: str, slow: str) -> float:
    """Median over rounds of the round's decode seconds of `slow` / those of `fast` (= tokens/s fast / slow)."""
    decode = measured["decode_seconds"]
    return round(statistics.median(s / f for f, s in zip(decode[fast], decode[slow])), 3)


def _rounds(measured: dict, fast: str, slow: str) -> list[float]:
    decode = measured["decode_seconds"]
    return sorted(round(s / f, 3) for f, s in zip(decode[fast], decode[slow]))


def _timed(side, new_tokens: int) -> float:
    t0 = time.perf_counter()
    generated = side(new_tokens)
    seconds = time.perf_counter() - t0
    expected = len(side.prompts) * new_tokens
    if generated != expected:
        raise RuntimeError(f"{type(side).__name__} generated {generated} tokens, expected {expected}")
    return seconds


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes/s one thread reads memory at: the fastest of `repeats` sums over a buffer far larger than the caches
    (torch's vectorised reduction: memory-bound). Decoding one sequence reads every weight once per token, so
    bandwidth / weight bytes bounds batch-1 tokens/s on any side, whatever its kernels."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def matmul_peak(sizes: Sequence[int] = (1024, 2048), repeats: int = 3) -> dict[str, float]:
    """FLOP/s of one thread's float32 matmul at its best, by kernel: torch's BLAS (`a @ b`, MKL) and oneDNN (the
    kernel the engine's packed weights and the trainer's `linear_kernel` use), each the fastest of `repeats` square
    products of each size (large enough that the kernel, not memory or dispatch, sets the time). A decode step's
    linear layers do 2 x parameters FLOPs per token, so the faster kernel's figure over that bounds tokens/s at any
    batch, on any side using torch's kernels, in float32. (MKL runs AVX2 code on AMD CPUs: on a Zen 5 EPYC oneDNN
    was 2.2x faster, so the BLAS figure alone is no bound there.)"""
    from pipelinerl.models.onednn import onednn_linear, onednn_works

    kernels = {"blas": lambda a, b: a @ b}
    if onednn_works(torch.device("cpu"), torch.float32):
        kernels["onednn"] = onednn_linear  # a @ b.T: the same FLOPs for square random operands
    best = dict.fromkeys(kernels, 0.0)
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for name, mm in kernels.items():
            mm(a, b)
            for _ in range(repeats):
                t0 = time.perf_counter()
                mm(a, b)
                best[name] = max(best[name], 2 * n**3 / (time.perf_counter() - t0))
    return best


def add_compute_roofline(row: dict, flops: float) -> None:
    """A row's compute roofline: tokens/s if a token cost only its linear layers' 2 x parameters multiply-adds
    (attention's left out, so a bound; the embedding is tied, so it is the LM head's product) at one thread's best
    float32 matmul speed, and each side's fraction of it."""
    roofline = flops / (2 * row["params"])
    row["compute_roofline_tokens_per_s"] = round(roofline, 2)
    row["compute_roofline_fraction"] = {side: round(tps / roofline, 3) for side, tps in row["tokens_per_s"].items()}


def add_roofline(row: dict, bandwidth: float) -> None:
    """A batch-1 row's memory roofline: tokens/s if every weight (float32) were read once per token at the measured
    bandwidth (the KV cache and activations left out, so a bound), and each side's fraction of it."""
    weight_bytes = row["params"] * 4
    roofline = bandwidth / weight_bytes
    row["weight_gb"] = round(weight_bytes / 1e9, 3)
    row["roofline_tokens_per_s"] = round(roofline, 2)
    row["roofline_fraction"] = {side: round(tps / roofline, 3) for side, tps in row["tokens_per_s"].items()}


def table(rows: list[dict]) -> str:
    """The Markdown table of decode tokens/s and ratios, one line per size and batch."""
    sides = ("engine", "hf", "engine_http", "vllm")
    lines = ["| model | batch | new tokens | " + " | ".join(sides)
             + " | engine / HF | engine_http / vLLM | engine's step in matmuls | memory roofline (batch 1) "
             "| compute roofline | most any engine could do over HF |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in sides) + " | ---:" * 6 + " |"]
    for r in rows:
        tps = [f"{r['tokens_per_s'][s]:.1f}" if s in r["tokens_per_s"] else "-" for s in sides]
        vllm = f"{r['vs_vllm']:.2f}x" if "vs_vllm" in r else "-"
        roof = f"{r['roofline_tokens_per_s']:.1f}" if "roofline_tokens_per_s" in r else "-"
        compute = f"{r['compute_roofline_tokens_per_s']:.1f}" if "compute_roofline_tokens_per_s" in r else "-"
        ceiling = f"{r['vs_hf_ceiling']:.2f}x" if "vs_hf_ceiling" in r else "-"
        profile = r.get("engine_decode_profile")
        matmuls = f"{profile['linear_share']:.0%}" if profile else "-"
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['batch']} | {r['new_tokens']} | "
                     + " | ".join(tps)
                     + f" | {r['vs_hf']:.2f}x | {vllm} | {matmuls} | {roof} | {compute} | {ceiling} |")
    return "\n".join(lines)


def _in_process_engine(path: Path):
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

    settings = EngineSettings(max_running_seqs=max(BATCHES), max_model_len=MAX_MODEL_LEN)
    return EmbeddedEngine(_load(path), str(path), settings)


class EngineSide:
    """`self(n)`: the whole batch submitted at once to the in-process engine, n new tokens each; returns the
    tokens generated."""

    def __init__(self, engine, prompts: list[list[int]]):
        self.engine, self.prompts = engine, prompts
        self.loop = asyncio.new_event_loop()

    def __call__(self, new_tokens: int) -> int:
        from pipelinerl.contracts.inference import GenerateRequest, SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        requests = [GenerateRequest(prompt_token_ids=p, sampling=params) for p in self.prompts]

        async def batch() -> list:
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))

        return sum(len(c.token_ids) for r in self.loop.run_until_complete(batch()) for c in r.completions)

    def close(self) -> None:
        self.loop.close()


class HFSide:
    """`self(n)`: `generate` on the batch, left-padded (pad id 0, masked), greedy, exactly n new tokens each."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]]):
        self.model, self.prompts = model, prompts
        longest = max(len(p) for p in prompts)
        device = next(model.parameters()).device  # the model's (engine_gpu runs both sides on a GPU)
        self.ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
        self.mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)

    def __call__(self, new_tokens: int) -> int:
        with torch.inference_mode():
            out = self.model.generate(self.ids, attention_mask=self.mask, do_sample=False, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=0)
        return (out.shape[1] - self.ids.shape[1]) * out.shape[0]

    def close(self) -> None:
        pass


class HttpSide:
    """`self(n)`: every prompt posted at once to a server's /v1/generate (engine_vs_vllm's client)."""

    def __init__(self, url: str, prompts: list[list[int]]):
        self.url, self.prompts = url, prompts

    def __call__(self, new_tokens: int) -> int:
        return _batch(self.url, self.prompts, new_tokens)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = run(quick=args.quick)
    print(f"wrote {write_result(NAME, result)}")
    print(result["table"])
    print(json.dumps({k: result[k] for k in ("ratio", "passed", "summary", "vllm_ratio_min", "seconds")}, indent=1))
