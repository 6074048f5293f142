"""SGLang behind the inference contract: `pipelinerl serve --engine sglang --model PATH` (or `engine.kind:
sglang` in a recipe).

SGLang's own server runs on a private loopback port and this package's thin front (`front.py`) serves the
contract over SGLang's native endpoints; no code of ours runs inside SGLang. SGLang has no CPU build on PyPI:
this is for GPU machines (`pip install -e ".[sglang]"`, SGLang 0.5.6 or later: see front.py). The engine's
tensor-parallel size (`--tensor-parallel-size`, config key engine.tensor_parallel_size) becomes SGLang's
`--tp-size`: each of its workers is a rank of the weight-update group. Extra `sglang.launch_server` arguments
can be given in the PIPELINERL_SGLANG_ARGS environment variable; the most bytes one weight-update call to SGLang
takes in UPDATE_CHUNK_ENV (MiB, config key weight_sync.sglang_update_chunk_mb, set by the launcher).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from pipelinerl.engines.sglang.kind import UPDATE_CHUNK_ENV
from pipelinerl.procs import free_port

EXTRA_ARGS_ENV = "PIPELINERL_SGLANG_ARGS"


def sglang_command(args: argparse.Namespace, port: int) -> list[str]:
    """The SGLang server's command line. The radix (prefix) cache is off: after an update, a cached prefix
    computed under the old weights would be reused."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", args.dtype, "--context-length", str(args.max_model_len),
            "--max-running-requests", str(args.max_running_seqs), "--tp-size", str(args.tensor_parallel_size),
            "--disable-radix-cache", "--log-level", args.log_level, *shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))]


def update_chunk_bytes() -> int:
    """The bound on one weight-update call, from UPDATE_CHUNK_ENV (the front's default when unset)."""
    from pipelinerl.engines.sglang.front import DEFAULT_UPDATE_CHUNK_BYTES

    value = os.environ.get(UPDATE_CHUNK_ENV)
    try:
        mib = float(value) if value else DEFAULT_UPDATE_CHUNK_BYTES / 2**20
    except ValueError:
        raise SystemExit(f"{UPDATE_CHUNK_ENV}={value!r} is not a number of MiB") from None
    if mib <= 0:
        raise SystemExit(f"{UPDATE_CHUNK_ENV}={value!r} must be > 0 (MiB)")
    return int(mib * 2**20)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 900.0) -> None:
    from pipelinerl.engines.common import wait_server_healthy

    wait_server_healthy("SGLang", url, proc, timeout_s, poll_s=0.5)


PORT_TRIES = 3


def start_healthy(args: argparse.Namespace, tries: int = PORT_TRIES) -> tuple[subprocess.Popen, str]:
    """Start SGLang on a free loopback port and wait until it is healthy: (process, URL). SGLang binds the port it
    is given only once its model is loaded (it takes no socket), so another process can take the port meanwhile
    (several engines starting at once): when SGLang exits before it is healthy and its port is taken by someone
    else, it is started again on another one."""
    for attempt in range(1, tries + 1):
        port = free_port()
        proc = subprocess.Popen(sglang_command(args, port))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, args.start_timeout_s)
            return proc, url
        except SystemExit:
            if proc.poll() is None or not port_in_use(port) or attempt == tries:
                stop_server(proc)
                raise
        print(f"pipelinerl: SGLang exited and port {port} is taken by another process; starting it on another port",
              file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def serve(args: argparse.Namespace) -> None:
    """Start SGLang, wait until it is healthy, then serve the contract on `args.host:args.port`."""
    from pipelinerl.contracts.routes import create_app
    from pipelinerl.engines.common import load_tokenizer, model_facts
    from pipelinerl.engines.listen import run_server
    from pipelinerl.engines.sglang.front import SGLangBackend, SGLangSettings

    try:
        import sglang  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--engine sglang needs SGLang ({e}); it has no CPU build: install it on a GPU machine "
                         "with `pip install -e '.[sglang]'`") from None
    settings = SGLangSettings(max_model_len=args.max_model_len, max_running_seqs=args.max_running_seqs,
                              initial_version=args.initial_version, update_chunk_bytes=update_chunk_bytes())
    facts, tokenizer = model_facts(args.model, args.dtype), load_tokenizer(args.model)
    proc, url = start_healthy(args)
    try:
        backend = SGLangBackend(url, args.model, facts, settings, tokenizer)
        try:
            backend.inspect_server()
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        app = create_app(backend, title="pipelinerl SGLang engine")
        app.router.on_shutdown.append(backend.aclose)
        run_server(app, args, f"pipelinerl sglang engine (SGLang on {url}) serving {args.model}")
    finally:
        stop_server(proc)
