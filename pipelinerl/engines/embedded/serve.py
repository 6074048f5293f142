"""Serving the embedded engine: `pipelinerl serve --engine embedded --model PATH` (see pipelinerl.serve)."""

from __future__ import annotations

import argparse
import os
import sys

from pipelinerl.engines.listen import run_server

GIL_SWITCH_INTERVAL_S = 0.0002


def load_model(path: str, dtype: str = "float32", device: str | None = None):
    """A transformers causal LM and its tokenizer (None when the directory has no tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(path) and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SystemExit(f"--model {path!r}: no such directory, and the hub is offline")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # a bare model directory: /v1/generate still works on token ids
        tokenizer = None
    return model, tokenizer


def build_app(args: argparse.Namespace):
    # torch is imported here, not with the module: `pipelinerl run` builds its parser (and so imports this module)
    # before it starts any role, and torch's import, seconds on a small machine, delayed every role's start by as
    # much (docs/benchmarks.md, section "Start-up")
    import torch

    from pipelinerl.contracts.routes import create_app
    from pipelinerl.engines.embedded.cpus import CpuListError, CpuSplit, parse_cpu_list
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    # The decoding thread lets go of the GIL inside every torch op and must win it back after each one; when
    # the HTTP or weight-receiving threads are running Python, it waits up to the switch interval (5 ms by
    # default). A short one gives it back sooner, so the decoding thread keeps more of its core while updates
    # arrive back to back (bench/engine_updates.py measures it).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        decode_cpus = parse_cpu_list(args.decode_cpus) if args.decode_cpus else None
        split = CpuSplit(decode_cpus)  # checked before the model loads
    except CpuListError as e:
        raise SystemExit(str(e)) from None
    # This thread serves HTTP and starts every other thread (receiving ones, gloo's) but the decoding one.
    split.pin_transfer()
    model, tokenizer = load_model(args.model, args.dtype)
    settings = EngineSettings(max_running_seqs=args.max_running_seqs, max_batch_tokens=args.max_batch_tokens,
                              max_model_len=args.max_model_len, initial_version=args.initial_version,
                              transposed_weights=args.transposed_weights, update_receiver=args.update_receiver)
    try:
        engine = EmbeddedEngine(model, args.model, settings, tokenizer, cpus=split)
    except ValueError as e:  # a setting that cannot work here (the message names it)
        raise SystemExit(f"cannot start the engine: {e}") from None
    if engine.receive_in_process:
        # Nothing of this process receives then, and this thread's Python (HTTP) holds the GIL that decoding
        # needs: among the transfer's processes it could lose its core mid-way and leave decoding waiting for a
        # time slice; beside the decoding thread it runs while that thread waits for the GIL anyway. Measured:
        # 0.998 of the tokens per decoding CPU second while updates arrived, against ~0.96 (engine_updates).
        split.pin_decoding()
    app = create_app(engine, title="pipelinerl embedded engine")
    app.router.on_shutdown.append(engine.shutdown)
    return app


def serve(args: argparse.Namespace) -> None:
    run_server(build_app(args), args, f"pipelinerl embedded engine serving {args.model}")
