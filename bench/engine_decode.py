"""Decode throughput of the embedded engine against Hugging Face `generate`, on the same tiny model.

Measured: generated tokens per second of wall time for one batch of BATCH greedy requests (prompts of
PROMPT_LEN random tokens, NEW_TOKENS new tokens each, EOS ignored), from submission to the last token, so
prefill is included on both sides:
- engine (in process, the main number): an `EmbeddedEngine` driven directly, the BATCH requests submitted
  together on one event loop;
- engine over HTTP (first model only): the same batch posted concurrently to a real engine server process
  (`pipelinerl serve`) through the actor's client (`AsyncEngineClient`, kept from round to round);
- engine without transposed copies: the in-process engine with `transposed_weights="none"` (the server's
  `--transposed-weights none`), multiplying by the weights as they are stored, to show what the copies
  contribute;
- Hugging Face: `model.generate(input_ids [BATCH, PROMPT_LEN], do_sample=False, max_new_tokens=NEW_TOKENS,
  min_new_tokens=NEW_TOKENS)` with its default DynamicCache.
Every side runs with THREADS torch threads; the runs are interleaved (warm-up, then REPEATS rounds, each
round one run of every side back to back). Target: `ratio` = engine (in process) tokens/s / Hugging Face
tokens/s >= 2 on the first (tiny) model, the median over rounds of each round's own ratio (as
`engine_updates` does): a round's two runs are seconds apart, so the machine's speed, which on a shared
virtual machine can move by half from one moment to the next, cancels out of it. `ratio_rounds` gives the
spread (min / median / max); `ratio_of_medians` (median Hugging Face seconds / median engine seconds) is the
statistic this benchmark used before, and moves most with the machine's speed. The other models are reported
alongside (sizes in `params`). `ratio_cpu_time` compares the CPU seconds this process spent instead of wall
seconds (with one thread each side runs on one core at a time), `ratio_best` the fastest repeat of each side.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch

from bench.common import interleaved, machine, median, model_settings, tiny_model, verdict

NAME = "engine_decode"
TARGET = 2.0
MODELS = ((128, 2), (256, 4))  # (hidden size, layers): the project's tiny model, then a slightly larger one
BATCH, PROMPT_LEN, NEW_TOKENS = 32, 16, 64
THREADS = 1
REPEATS, QUICK_REPEATS = 11, 3


def run(quick: bool = False) -> dict:
    """Measure every model in MODELS (only the first with `quick`); returns the JSON-able result."""
    torch.set_num_threads(THREADS)
    repeats = QUICK_REPEATS if quick else REPEATS
    prompts = torch.randint(4, 100, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        paths = [tiny_model(tmp, h, n) for h, n in (MODELS[:1] if quick else MODELS)]
        rows = [measure_model(path, prompts, repeats, with_http=(i == 0), log_dir=Path(tmp))
                for i, path in enumerate(paths)]
    main = rows[0]
    return {
        "name": NAME,
        **verdict(main["ratio"], TARGET),
        "ratio_is": f"engine in process / HF generate, tokens/s, model {main['model']} ({main['params']} params)",
        "summary": "; ".join(f"{r['model']} ({r['params'] / 1e6:.1f}M): {r['ratio']:.2f}x in process "
                             f"(rounds {r['ratio_rounds']['min']:.2f}-{r['ratio_rounds']['max']:.2f})"
                             + (f", {r['ratio_http']:.2f}x over HTTP" if "ratio_http" in r else "")
                             for r in rows),
        "models": rows,
        "settings": {"batch": BATCH, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "threads": THREADS,
                     "repeats": repeats, "statistic": "median of the per-round ratios of interleaved rounds",
                     "sampling": "greedy", "dtype": "float32"},
        "machine": machine(),
    }


def measure_model(path: Path, prompts: torch.Tensor, repeats: int, with_http: bool, log_dir: Path) -> dict:
    """Interleaved timings of every side on one model: tokens/s from the medians, ratios per round."""
    engine = _in_process_engine(path)
    plain_engine = _in_process_engine(path, transposed="none")
    hf = _load(path)
    runs = {"engine": EngineBatch(engine, prompts), "engine_no_copies": EngineBatch(plain_engine, prompts),
            "hf": lambda: _hf_batch(hf, prompts)}
    server = _start_server(path, log_dir) if with_http else None
    try:
        if server is not None:
            runs["engine_http"] = HttpBatch(server[0].url, prompts)
        wall, cpu = interleaved(runs, repeats)
    finally:
        step_ms = 1000 * engine.metrics.decode_seconds / max(engine.metrics.decode_steps, 1)
        for r in runs.values():
            if isinstance(r, (EngineBatch, HttpBatch)):
                r.close()
        if server is not None:
            _stop_server(server)
    tokens = BATCH * NEW_TOKENS
    med = {name: median(ts) for name, ts in wall.items()}
    med_cpu = {name: median(cpu[name]) for name in ("engine", "engine_no_copies", "hf")}
    def per_round(side: str) -> list[float]:
        return sorted(h / e for h, e in zip(wall["hf"], wall[side]))

    rounds = per_round("engine")
    row = {"model": path.name.split("-", 1)[1], "params": sum(p.numel() for p in hf.parameters()),
           **model_settings(path), "tokens_per_batch": tokens,
           **{f"{name}_tokens_per_s": round(tokens / s, 1) for name, s in med.items()},
           "ratio": round(median(rounds), 3),
           "ratio_rounds": {"min": round(rounds[0], 3), "median": round(median(rounds), 3),
                            "max": round(rounds[-1], 3)},
           "ratio_of_medians": round(med["hf"] / med["engine"], 3)}
    if "engine_http" in med:
        row["ratio_http"] = round(median(per_round("engine_http")), 3)
    row.update({
        "ratio_no_copies": round(median(per_round("engine_no_copies")), 3),
        "ratio_best": round(min(wall["hf"]) / min(wall["engine"]), 3),
        "ratio_cpu_time": round(med_cpu["hf"] / med_cpu["engine"], 3),
        "ratio_cpu_time_no_copies": round(med_cpu["hf"] / med_cpu["engine_no_copies"], 3),
        "engine_decode_step_ms": round(step_ms, 3),
        "wall_seconds": {name: [round(t, 4) for t in ts] for name, ts in wall.items()},
        "cpu_seconds": {name: [round(cpu[name][i], 4) for i in range(len(cpu[name]))] for name in med_cpu},
    })
    return row


def _load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def _in_process_engine(path: Path, transposed: str = "auto"):
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

    settings = EngineSettings(max_running_seqs=BATCH, max_model_len=PROMPT_LEN + NEW_TOKENS,
                              transposed_weights=transposed)
    return EmbeddedEngine(_load(path), str(path), settings)


class EngineBatch:
    """Calling it submits the whole batch to an in-process engine at once and waits for every token."""

    def __init__(self, engine, prompts: torch.Tensor):
        from pipelinerl.contracts.inference import GenerateRequest, SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        self.engine = engine
        self.requests = [GenerateRequest(prompt_token_ids=p, sampling=params) for p in prompts.tolist()]
        self.loop = asyncio.new_event_loop()

    def __call__(self) -> None:
        _check(self.loop.run_until_complete(self._batch()))

    async def _batch(self) -> list:
        return await asyncio.gather(*(self.engine.generate(r) for r in self.requests))

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def _check(responses: list) -> None:
    generated = sum(len(c.token_ids) for r in responses for c in r.completions)
    if generated != BATCH * NEW_TOKENS:
        raise RuntimeError(f"the engine generated {generated} tokens, expected {BATCH * NEW_TOKENS}")


def _hf_batch(model: torch.nn.Module, prompts: torch.Tensor) -> None:
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    if out.shape != (BATCH, PROMPT_LEN + NEW_TOKENS):
        raise RuntimeError(f"generate returned {tuple(out.shape)}")


def _start_server(path: Path, log_dir: Path):
    from pipelinerl.engines.client import EngineClient
    from pipelinerl.procs import engine_command, free_port, start_process, tail

    port = free_port()
    log = log_dir / f"engine-{port}.log"
    extra = ["--max-running-seqs", str(BATCH), "--max-model-len", str(PROMPT_LEN + NEW_TOKENS),
             "--threads", str(THREADS)]
    proc = start_process(engine_command(str(path), port, extra=extra), log, threads=THREADS)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        client.wait_healthy(timeout_s=120, process=proc)
    except Exception as e:
        _stop_server((client, proc))
        raise RuntimeError(f"{e}\n--- engine log ---\n{tail(log)}") from e
    return client, proc


def _stop_server(server) -> None:
    from pipelinerl.procs import stop_process

    client, proc = server
    client.close()
    stop_process(proc)


class HttpBatch:
    """Calling it posts the whole batch at once through the actor's client (`AsyncEngineClient`, one request
    per prompt on one event loop) and waits for every answer."""

    def __init__(self, url: str, prompts: torch.Tensor):
        from pipelinerl.contracts.inference import GenerateRequest, SamplingParams
        from pipelinerl.engines.client import AsyncEngineClient

        params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        self.requests = [GenerateRequest(prompt_token_ids=p, sampling=params) for p in prompts.tolist()]
        self.client = AsyncEngineClient(url)
        self.loop = asyncio.new_event_loop()

    def __call__(self) -> None:
        _check(self.loop.run_until_complete(self._batch()))

    async def _batch(self) -> list:
        return await asyncio.gather(*(self.client.generate(r) for r in self.requests))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
