"""The engine process role: `pipelinerl serve --engine embedded --model PATH` serves the inference contract."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from pipelinerl.auth import ApiKeyMiddleware, serve_api_key
from pipelinerl.cli_args import model_directory, non_negative_int, port_number, positive_float, positive_int

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm", "sglang"],
                   help="inference engine behind the contract")
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


GIL_SWITCH_INTERVAL_S = 0.0002
SHUTDOWN_GRACE_S = 5.0  # see run_server
EXIT_DEADLINE_S = 10.0  # see exit_deadline


def build_app(args: argparse.Namespace):
    # torch is imported here, not with the module: `pipelinerl run` builds its parser (and so imports this module)
    # before it starts any role, and torch's import (1.6 s on 2 cores) delayed every role's start by as much
    import torch

    from pipelinerl.engines.embedded.cpus import CpuListError, CpuSplit, parse_cpu_list
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings
    from pipelinerl.engines.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    # The decoding thread lets go of the GIL inside every torch op and must win it back after each one; when
    # the HTTP or weight-receiving threads are running Python, it waits up to the switch interval (5 ms by
    # default). A short one gives it back sooner: the decoding thread kept 0.961-0.962 of its core while
    # updates arrived back to back, 0.973-0.976 with this (bench/engine_updates.py, 2+ runs each).
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


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # before any model loads: a refused start is immediate
        args.api_key = serve_api_key(args.api_key_file, args.host, args.allow_unauthenticated)
    except ValueError as e:
        raise SystemExit(f"--api-key-file: {e}") from None
    args.model = model_directory(args.model)  # a missing or malformed model: one line, before anything starts
    if args.engine == "vllm":
        from pipelinerl.engines.vllm import serve as serve_vllm

        return serve_vllm(args)
    if args.engine == "sglang":
        from pipelinerl.engines.sglang import serve as serve_sglang

        return serve_sglang(args)
    run_server(build_app(args), args, f"pipelinerl {args.engine} engine serving {args.model}")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; port 0 takes a free one. Binding here (not in uvicorn) lets the server
    report the port it got, so launchers never pick a port that someone else takes before the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a
    # socket that says it is TCP. With Nagle on, uvicorn's answer (headers, then body: two writes) held its body
    # back until the client acknowledged the headers, which a client delaying its ACK does 40 ms later: 40 ms on
    # about every other weight update or health check of the trainer's, and on engine answers to the actor
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another port, "
                         "or --port 0 for any free one") from None
    sock.listen(2048)
    return sock


def run_server(app, args: argparse.Namespace, banner: str) -> None:
    """Serve `app` with uvicorn on --host/--port until stopped, writing --port-file once listening."""
    import uvicorn

    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    print(f"{banner} on http://{args.host}:{port}" + (" (API key required)" if api_key else ""), flush=True)
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)  # readers never see a half-written number
    # On SIGTERM uvicorn stops listening, then waits for the requests in flight: at most SHUTDOWN_GRACE_S, after
    # which they are cancelled (a client's long generation, a weight update whose trainer is gone), so that the
    # engine's own shutdown runs and the process ends in bounded time
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    app.router.on_shutdown.insert(0, exit_deadline)
    uvicorn.Server(config).run(sockets=[sock])


def exit_deadline(deadline_s: float | None = None) -> None:
    """From the start of the shutdown, the process has `deadline_s` (EXIT_DEADLINE_S) to end by itself; then it
    ends anyway. What the shutdown waits for is bounded, but a thread stuck in a C++ call (a rendezvous that keeps
    retrying, a broadcast whose peer is gone) is joined at the interpreter's exit and could hold it for minutes."""
    import threading

    seconds = EXIT_DEADLINE_S if deadline_s is None else deadline_s

    def force() -> None:
        log.warning("still running %g s after the shutdown began (a thread stuck in a transfer or a rendezvous); "
                    "exiting now", seconds)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
