"""The engine process role: `pipelinerl serve --engine KIND --model PATH` serves the inference contract with the
engine kind `--engine` names (pipelinerl.plugins.ENGINES; each kind says how it serves: pipelinerl.contracts.engine)."""

from __future__ import annotations

import argparse
import logging

from pipelinerl.auth import serve_api_key
from pipelinerl.cli_args import model_directory, non_negative_int, port_number, positive_float, positive_int
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.plugins import ENGINES

log = logging.getLogger(__name__)


def _engine_name(name: str) -> str:
    if not ENGINES.knows(name):
        raise argparse.ArgumentTypeError(f"unknown engine kind {name!r}; registered: {ENGINES.choices()}")
    return name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="embedded", type=_engine_name,
                   help=f"inference engine behind the contract: {ENGINES.choices()}")
    p.add_argument("--model", required=True, help="local Hugging Face model directory (or a hub name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only; any other address "
                                                        "needs an API key)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="a file holding the key every route but /v1/health requires (Authorization: Bearer); "
                        "default: the PIPELINERL_API_KEY environment variable; none: no key")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback --host without a key (only on a network you trust)")
    p.add_argument("--port", type=port_number, default=8100, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", default=None,
                   help="write the port listened on to this file once bound (how a launcher learns a free port)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-seqs", type=positive_int, default=64, help="sequences decoded together")
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, help="KV-cache tokens of running sequences")
    p.add_argument("--max-model-len", type=positive_int, default=512, help="prompt + generated tokens per sequence")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--decode-cpus", default=None, metavar="LIST",
                   help="embedded engine on CPU: run decoding on these CPUs (e.g. 0 or 0-3) and receive weight "
                        "updates on the others, so that updates do not take the decoding's cores")
    p.add_argument("--transposed-weights", default="auto", choices=["auto", "all", "none", "packed"],
                   help="embedded engine on CPU: keep copies of the weights stored transposed, or packed in "
                        "oneDNN's layout, where that makes decoding faster (auto: where timed faster on this "
                        "machine at start-up; all: transposed, every weight; packed: packed, every weight whose "
                        "shape allows; none: no second copy of the weights in memory). Rebuilt after each "
                        "update, off the decoding thread")
    p.add_argument("--update-receiver", default="auto", choices=["auto", "process", "thread"],
                   help="embedded engine: receive weight updates in a process of its own, the weights in shared "
                        "memory (process: no GIL shared with decoding; CPU only), or on a thread of the server "
                        "(thread). auto: a process on CPU, a thread on GPU")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="vllm, sglang: workers (GPUs) per engine, each a rank of the weight-update group")
    p.add_argument("--initial-version", type=non_negative_int, default=0, help="weight version of the loaded weights")
    p.add_argument("--start-timeout-s", type=positive_float, default=900.0,
                   help="vllm, sglang: seconds the engine behind the front may take to load the model and answer its "
                        "health check (a launcher passes engine.start_timeout_s)")
    p.add_argument("--log-level", default="warning")


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # before any model loads: a refused start is immediate
        args.api_key = serve_api_key(args.api_key_file, args.host, args.allow_unauthenticated)
    except ValueError as e:
        raise SystemExit(f"--api-key-file: {e}") from None
    args.model = model_directory(args.model)  # a missing or malformed model: one line, before anything starts
    engine_kind(args.engine).run(args)
