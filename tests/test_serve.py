"""The servers' listening socket (`pipelinerl.engines.listen.bind`), which uvicorn serves on, and the command line
in front of it."""

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from pipelinerl.engines.listen import bind


async def _nodelay_of_accepted(listener: socket.socket) -> int:
    """TCP_NODELAY on the server's side of a connection accepted by an asyncio server on `listener` (uvicorn
    serves a socket handed to it the same way: `loop.create_server(..., sock=...)`)."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(accepted, 10)
        writer.close()
    return value


def test_served_connections_send_small_writes_at_once():
    """An answer is written in two parts (headers, then body). With Nagle's algorithm on, the body waits until
    the client has acknowledged the headers, which a client delaying its ACK does 40 ms later: the trainer's
    weight updates and health checks took 40 ms longer every other step. asyncio disables it only on connections
    of a socket created as TCP (IPPROTO_TCP), which `bind` must give."""
    listener = bind("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP
    assert asyncio.run(_nodelay_of_accepted(listener)) != 0
    # the socket it replaced (protocol left 0) kept Nagle on: what this test guards against
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    assert asyncio.run(_nodelay_of_accepted(plain)) == 0


def test_pipelinerl_run_parses_its_command_line_and_counts_gpus_without_torch():
    """The launcher parses its command line and counts GPUs before it starts any role; torch's import there
    (1.6 s on 2 cores, through the parsers of `serve` and `conformance`, and again to count no GPUs) delayed every
    role's start. (Checking the recipe's algorithm names still imports it: the registry's built-in losses are
    torch functions.)"""
    from pipelinerl.placement import GPU_DEVICE_FILES

    if any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        pytest.skip("a GPU driver is here: counting GPUs asks torch")
    code = ("import sys; from pipelinerl import cli; from pipelinerl.placement import detect_gpus; "
            "args = cli.build_parser('run').parse_args(['run', 'recipes/tiny_cpu.yaml', 'trainer.lr=1e-3']); "
            "assert args.overrides == ['trainer.lr=1e-3'] and detect_gpus() == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
