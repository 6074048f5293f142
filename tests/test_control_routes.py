"""The routes that wait on torch.distributed end in bounded time however the rendezvous fails, and leave the engine
as it was; and SIGTERM ends an engine in bounded time whatever it is waiting on.

`POST /v1/weights/init_group` against each way a rendezvous fails: a refused port, an address that does not
answer, a peer that answers something else, and one that accepts and never answers (half open). Each answers the
contract's 504 within its `timeout_s` and a few seconds, the engine in no group, generating as before, and able to
join a real group afterwards. Before, torch's TCPStore client kept retrying past the request's timeout, and an
engine stopped meanwhile stayed alive for more than 5 minutes after SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import running_engine

from pipelinerl.engines.client import init_group_on_engines, push_weights
from pipelinerl.procs import free_port
from pipelinerl.weight_sync import init_weight_update_group

pytestmark = pytest.mark.slow
TIMEOUT_S = 2.0
BOUND_S = TIMEOUT_S + 10.0  # the request's timeout, the join's grace and the answer's way back


@contextlib.contextmanager
def peer(kind: str):
    """(address, port) of a rendezvous that fails in the way `kind` says."""
    if kind == "refused":
        yield "127.0.0.1", free_port()  # nothing listens there
        return
    if kind == "unreachable":
        yield "192.0.2.1", 29500  # TEST-NET-1 (RFC 5737): routed nowhere
        return
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if kind == "wrong_peer":
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                conn.close()
            else:  # half open: accepted, never answered
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def init_group(url: str, address: str, port: int, timeout_s: float = TIMEOUT_S) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    resp = httpx.post(f"{url}/v1/weights/init_group", timeout=120,
                      json={"master_address": address, "master_port": port, "rank_offset": 1, "world_size": 2,
                            "backend": "gloo", "group_name": "bounded", "timeout_s": timeout_s})
    return resp, time.monotonic() - start


@pytest.mark.parametrize("receiver", ["process", "thread"])
def test_init_group_ends_within_its_timeout_however_the_rendezvous_fails(tiny_model_dir, tmp_path, receiver):
    with running_engine(tiny_model_dir, tmp_path, extra=["--update-receiver", receiver]) as client:
        before = client.generate([5, 6, 7], temperature=0, max_new_tokens=8, ignore_eos=True).completions[0]
        for kind in ("refused", "unreachable", "wrong_peer", "half_open"):
            with peer(kind) as (address, port):
                resp, took = init_group(client.url, address, port)
            assert resp.status_code == 504, (kind, resp.text)
            assert resp.json()["error"]["type"] == "weight_sync_error" and took < BOUND_S, (kind, took, resp.text)
            assert client.info().weight_group is None, kind
            again = client.generate([5, 6, 7], temperature=0, max_new_tokens=8, ignore_eos=True).completions[0]
            assert again.token_ids == before.token_ids, kind
        # and a real group still forms, and carries an update
        port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", port, "gloo", "real", 60)
        group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", "real", 60)
        try:
            for f in futures:
                f.result()
            assert client.info().weight_group == "real"
        finally:
            group.destroy()


def test_sigterm_ends_an_engine_waiting_on_a_rendezvous_that_never_answers(tiny_model_dir, tmp_path):
    """A join of 120 s against a half-open peer, then SIGTERM: the engine is gone in seconds, not minutes."""
    with peer("half_open") as (address, port), running_engine(tiny_model_dir, tmp_path) as client:
        def wait_for_join() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the engine goes away with the request in flight
                init_group(client.url, address, port, 120.0)

        waiting = threading.Thread(target=wait_for_join, daemon=True)
        waiting.start()
        time.sleep(1.0)  # the join is under way
        start = time.monotonic()
        client.process.send_signal(signal.SIGTERM)
        client.process.wait(timeout=60)
        took = time.monotonic() - start
    assert took < 20, f"the engine took {took:.1f} s to end after SIGTERM"


def test_a_failed_join_leaves_a_working_engine_for_updates(tiny_model_dir, tmp_path):
    """After a refused rendezvous, an update over a group joined later changes the weights as pushed."""
    from pipelinerl.conformance import Reference

    ref = Reference(str(tiny_model_dir))
    with running_engine(tiny_model_dir, tmp_path) as client:
        with peer("refused") as (address, port):
            assert init_group(client.url, address, port)[0].status_code == 504
        port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", port, "gloo", "later", 60)
        group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", "later", 60)
        try:
            for f in futures:
                f.result()
            before = client.generate([5, 6, 7], temperature=0, max_new_tokens=8, ignore_eos=True).completions[0]
            push_weights(group, [client], ref.named(ref.perturbed(seed=3)), client.info().weight_version + 1)
            after = client.generate([5, 6, 7], temperature=0, max_new_tokens=8, ignore_eos=True).completions[0]
            assert client.info().weight_version == 1 and set(after.versions) == {1}
            assert after.token_ids != before.token_ids or after.logprobs != before.logprobs
        finally:
            group.destroy()


@pytest.mark.parametrize("receiver", ["process", "thread"])
def test_sigterm_ends_an_engine_with_a_broadcast_half_received(tiny_model_dir, tmp_path, receiver):
    """The trainer sends an update, broadcasts its first tensor and then nothing (a trainer stalled or gone with its
    group held open): the engine, SIGTERMed while it waits for the rest, is gone in seconds."""
    from pipelinerl.conformance import Reference
    from pipelinerl.engines.client import update_request_body

    ref = Reference(str(tiny_model_dir))
    named = ref.named(ref.base)
    with running_engine(tiny_model_dir, tmp_path, extra=["--update-receiver", receiver]) as client:
        port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", port, "gloo", "stalls", 300)
        group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", "stalls", 300)
        try:
            for f in futures:
                f.result()
            client.send_update(update_request_body(named, 1, "stalls", 0))
            group.broadcast(named[0][1].contiguous())  # one tensor of many, then nothing
            time.sleep(1.0)
            start = time.monotonic()
            client.process.send_signal(signal.SIGTERM)
            client.process.wait(timeout=60)
            took = time.monotonic() - start
            client.abandon_update()
        finally:
            group.destroy()
    assert took < 20, f"the engine took {took:.1f} s to end after SIGTERM with a broadcast half received"
