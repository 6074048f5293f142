"""The engine process role: `pipelinerl serve --engine embedded --model PATH` serves the inference contract."""

from __future__ import annotations

import argparse
import logging
import os

import torch

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm", "sglang"],
                   help="inference engine behind the contract")
    p.add_argument("--model", required=True, help="local Hugging Face model directory (or a hub name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="KV-cache tokens of running sequences")
    p.add_argument("--max-model-len", type=int, default=512, help="prompt + generated tokens per sequence")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--initial-version", type=int, default=0, help="weight version of the loaded weights")
    p.add_argument("--log-level", default="warning")


def load_model(path: str, dtype: str = "float32", device: str | None = None):
    """A transformers causal LM and its tokenizer (None when the directory has no tokenizer)."""
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
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings
    from pipelinerl.engines.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, args.dtype)
    settings = EngineSettings(max_running_seqs=args.max_running_seqs, max_batch_tokens=args.max_batch_tokens,
                              max_model_len=args.max_model_len, initial_version=args.initial_version)
    engine = EmbeddedEngine(model, args.model, settings, tokenizer)
    app = create_app(engine, title="pipelinerl embedded engine")
    app.router.on_shutdown.append(engine.shutdown)
    return app


def main(args: argparse.Namespace) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.engine == "vllm":
        from pipelinerl.engines.vllm import serve as serve_vllm

        return serve_vllm(args)
    if args.engine == "sglang":
        from pipelinerl.engines.sglang import serve as serve_sglang

        return serve_sglang(args)
    app = build_app(args)
    print(f"pipelinerl {args.engine} engine serving {args.model} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
