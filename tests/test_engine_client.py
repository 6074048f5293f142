"""The engine client's update connection: a request sent without waiting for its answer, over a keep-alive
connection that the server may have closed while idle between two updates."""

import json
import socket
import threading
import time

import pytest
import torch

from pipelinerl.contracts.inference import UpdateWeightsRequest
from pipelinerl.engines.client import EngineClient, EngineError, update_request_body

ANSWER = json.dumps({"version": 1, "received_bytes": 8, "receive_s": 0.0, "switch_s": 0.0}).encode()


def serve(listener: socket.socket, bodies: list[bytes], statuses: list[int], closed: threading.Semaphore) -> None:
    """Answer one request per connection, then close it soon after, as a server's keep-alive timeout does
    (releasing `closed` once it has)."""
    for status in statuses:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            bodies.append(body)
            answer = ANSWER if status == 200 else json.dumps({"error": {"message": "nope", "field": "x"}}).encode()
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (status, len(answer), answer))
            time.sleep(0.05)
        closed.release()


def test_updates_survive_a_keep_alive_connection_the_server_closed():
    listener = socket.create_server(("127.0.0.1", 0))
    bodies: list[bytes] = []
    closed = threading.Semaphore(0)
    server = threading.Thread(target=serve, args=(listener, bodies, [200, 200, 409], closed), daemon=True)
    server.start()
    client = EngineClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=10)
    named = [("a.weight", torch.zeros(2, 3)), ("a.bias", torch.zeros(3, dtype=torch.bfloat16))]
    try:
        for version in (1, 2):
            client.send_update(update_request_body(named, version, "weight_update", 64))
            # headers and body are written apart: the body must not wait for the headers' ACK (Nagle)
            assert client._update_conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert client.finish_update().version == 1
            assert closed.acquire(timeout=10)  # the server has closed the idle connection meanwhile
        client.send_update(update_request_body(named, 3, "weight_update", 64))
        with pytest.raises(EngineError, match="nope") as err:
            client.finish_update()
        assert err.value.status == 409 and err.value.field == "x"
    finally:
        client.close()
        listener.close()
    requests = [UpdateWeightsRequest.model_validate_json(b) for b in bodies]
    assert [r.version for r in requests] == [1, 2, 3]
    assert [(p.name, p.dtype, p.shape) for p in requests[0].params] == [("a.weight", "float32", [2, 3]),
                                                                        ("a.bias", "bfloat16", [3])]
    assert requests[0].bucket_bytes == 64 and requests[0].group_name == "weight_update"


def test_async_client_generates_and_reports_errors(tiny_model_dir, tmp_path):
    """The actor's client against a real engine: the same completion as the blocking client, a 4xx naming the
    field, and an unreachable engine named in the error."""
    import asyncio

    from conftest import running_engine

    from pipelinerl.contracts.inference import GenerateRequest, SamplingParams
    from pipelinerl.engines.client import AsyncEngineClient
    from pipelinerl.procs import free_port

    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with running_engine(tiny_model_dir, tmp_path) as client:
        expected = client.generate([5, 6, 7], temperature=0, max_new_tokens=12, ignore_eos=True)

        async def calls():
            engine = AsyncEngineClient(client.url)
            try:
                answers = await asyncio.gather(*(engine.generate(GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                                                 sampling=params))
                                                 for _ in range(8)))
                assert engine.in_flight == 0
                with pytest.raises(EngineError) as bad:
                    await engine.generate(GenerateRequest(prompt_token_ids=[5, 10**6], sampling=params))
                return answers, bad.value
            finally:
                await engine.aclose()

        answers, bad = asyncio.run(calls())
    assert all(a.completions[0].token_ids == expected.completions[0].token_ids for a in answers)
    assert bad.status == 400 and bad.field == "prompt_token_ids[1]"

    async def unreachable():
        engine = AsyncEngineClient(f"http://127.0.0.1:{free_port()}")
        try:
            await engine.generate(GenerateRequest(prompt_token_ids=[5], sampling=params))
        finally:
            await engine.aclose()

    with pytest.raises(ConnectionError, match="unreachable.*is it running"):
        asyncio.run(unreachable())
