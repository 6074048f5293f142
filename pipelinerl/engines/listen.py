"""The servers' listening socket and their uvicorn loop, with a bounded shutdown: every engine kind serves its app
(pipelinerl.contracts.routes.create_app) through `run_server`."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from pipelinerl.auth import ApiKeyMiddleware

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # see run_server
EXIT_DEADLINE_S = 10.0  # see exit_deadline


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
