"""SGLang behind the contract. SGLang has no CPU build on PyPI, so SGLang itself runs only in the conformance test
(skipped without it and a GPU). Everywhere else the front is tested against a stand-in server that answers
SGLang's API as a given release does and joins the weight-update group and receives updates exactly as SGLang
does (tests/helpers/sglang_standin.py): the update's chunks, their order and bound, the pause around them, the version
switch, a failing chunk, and the releases the front refuses."""

import asyncio
import hashlib
import importlib.util
import os
import sys
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from pipelinerl.contracts.inference import InitWeightUpdateGroupRequest, ParamSpec, UpdateWeightsRequest
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.common import ModelFacts, versions_from_spans
from pipelinerl.engines.sglang import sglang_command
from pipelinerl.engines.sglang.front import SGLangBackend, SGLangSettings, _span, update_chunks
from pipelinerl.procs import free_port, start_process, stop_process, tail, wait_for_port
from pipelinerl.weight_sync import DTYPE_NAMES, broadcast_tensors, host_rendezvous, init_weight_update_group

ROOT = Path(__file__).resolve().parents[1]
STANDIN = str(Path(__file__).parent / "helpers" / "sglang_standin.py")
GROUP = "sglang_front"


def test_weight_version_spans_become_per_token_versions():
    assert [_span(s) for s in ({"version": "3", "start": 0, "end": 2}, ["4", 2, 5], {"version": "default"})] == [
        (3, 0, 2), (4, 2, 5), None]
    assert versions_from_spans([(3, 0, 2), (4, 2, 5)], 5, fallback=0) == [3, 3, 4, 4, 4]
    # tokens no span covers take the version before them; no spans at all: the fallback
    assert versions_from_spans([(3, 0, 2)], 4, fallback=1) == [3, 3, 3, 3]
    assert versions_from_spans(None, 3, fallback=7) == [7, 7, 7]


def param_specs(named: list[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    return [ParamSpec(name=n, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape)) for n, t in named]


def test_update_chunks_split_the_update_in_order_within_the_bound():
    params = param_specs([("a", torch.empty(256)), ("b", torch.empty(512, dtype=torch.bfloat16)),
                          ("c", torch.empty(100)), ("big", torch.empty(64, 64)), ("d", torch.empty(300).half()),
                          ("e", torch.empty(10))])
    # bytes: 1024, 1024, 400, 16384 (over the bound: alone), 600, 40
    assert update_chunks(params, 4096) == [(0, 3), (3, 4), (4, 6)]
    assert update_chunks(params, 2048) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert update_chunks(params, 1 << 30) == [(0, 6)]
    assert update_chunks([], 4096) == []


def test_the_launcher_gives_sglang_the_tensor_parallel_size():
    args = Namespace(model="/m", dtype="bfloat16", max_model_len=4096, max_running_seqs=64, tensor_parallel_size=4,
                     log_level="warning")
    command = sglang_command(args, 30000)
    assert command[command.index("--tp-size") + 1] == "4"


def test_an_engine_whose_tensor_parallel_ranks_do_not_fit_is_refused_before_sglang_is_asked():
    front = SGLangBackend("http://127.0.0.1:9", "m", facts([]), SGLangSettings(max_model_len=64, max_running_seqs=4))
    front.server_version, front.tp_size = "0.5.23", 2  # as inspect_server reads them from a TP-2 server
    request = InitWeightUpdateGroupRequest(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2,
                                           backend="gloo", group_name=GROUP)
    with pytest.raises(ContractError) as err:
        asyncio.run(front.init_weight_update_group(request))  # nothing listens at the URL: it must not be asked
    assert err.value.status == 400 and err.value.field == "world_size"
    assert "2 tensor-parallel workers" in err.value.message and "ranks 1..2" in err.value.message


def facts(named: list[tuple[str, torch.Tensor]]) -> ModelFacts:
    params = {p.name: (p.dtype, p.shape) for p in param_specs(named)}
    return ModelFacts(vocab_size=100, eos_token_ids=[0], params=params, tied_embeddings=False, max_positions=None)


class StandIn:
    """tests/helpers/sglang_standin.py serving SGLang's API as `version` does, in a process of its own."""

    def __init__(self, tmp_path: Path, version: str, fail_call: int = 0):
        self.log = tmp_path / f"standin-{version}.log"
        port_file = tmp_path / f"standin-{version}.port"
        port_file.unlink(missing_ok=True)
        self.proc = start_process([sys.executable, STANDIN, "serve", "--version", version, "--fail-call",
                                   str(fail_call), "--port-file", str(port_file)], self.log)
        try:
            self.url = f"http://127.0.0.1:{wait_for_port(port_file, self.proc, 60)}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and self.proc.poll() is None, tail(self.log)
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def calls(self) -> list[dict]:
        return httpx.get(self.url + "/standin/log", timeout=10).json()

    def stop(self) -> None:
        stop_process(self.proc)


class Front:
    """The SGLang front over `url`, its coroutines run on an event loop of their own on a worker thread while
    the test's thread is the trainer (rank 0)."""

    def __init__(self, url: str, named: list[tuple[str, torch.Tensor]], chunk_bytes: int):
        settings = SGLangSettings(max_model_len=64, max_running_seqs=4, update_chunk_bytes=chunk_bytes)
        self.backend = SGLangBackend(url, "standin", facts(named), settings)
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(1)

    def start(self, coroutine):
        return self.pool.submit(self.loop.run_until_complete, coroutine)

    def join(self) -> object:
        """Form the group with the stand-in as the trainer does (`Trainer.connect_engines`)."""
        store = host_rendezvous("127.0.0.1", world_size=2, timeout_s=60)
        joined = self.start(self.backend.init_weight_update_group(InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, backend="gloo",
            group_name=GROUP)))
        group = init_weight_update_group("127.0.0.1", store.port, 0, 2, "gloo", GROUP, timeout_s=60, store=store)
        joined.result(timeout=60)
        return group

    def update(self, group, named: list[tuple[str, torch.Tensor]], version: int):
        done = self.start(self.backend.update_weights(UpdateWeightsRequest(
            version=version, params=param_specs(named), group_name=GROUP, bucket_bytes=0)))
        broadcast_tensors(group, [t for _, t in named], bucket_bytes=0)
        return done.result(timeout=60)

    def close(self) -> None:
        self.start(self.backend.aclose()).result(timeout=10)
        self.pool.shutdown()
        self.loop.close()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_an_update_reaches_sglang_in_bounded_chunks_while_generation_is_paused(tmp_path, version):
    """The front against the oldest and the newest SGLang it supports: it joins (and joins again, as after a
    trainer restart), then an update goes in consecutive calls of at most the bound, each receiving its tensors
    bit-exactly from the trainer's per-tensor broadcast, all while generation is paused in place, and the version
    is switched after the last. A later update whose last call fails resumes generation and names the chunk."""
    g = torch.Generator().manual_seed(5)
    named = [("a", torch.randn(256, generator=g)), ("b", torch.randn(512, generator=g).bfloat16()),
             ("c", torch.randn(10, 10, generator=g)), ("big", torch.randn(64, 64, generator=g)),
             ("d", torch.randn(300, generator=g).half()), ("e", torch.randn(2, 5, generator=g))]
    bound = 4096  # bytes: 1024, 1024, 400 | 16384 (alone) | 600, 40
    standin = StandIn(tmp_path, version, fail_call=6)  # the last call of the second update fails
    front = Front(standin.url, named, bound)
    groups = []
    try:
        front.backend.inspect_server()
        assert (front.backend.server_version, front.backend.tp_size) == (version, 1)
        groups.append(front.join())
        groups[-1].destroy()  # the trainer restarts: a new rendezvous, the same group name
        groups.append(front.join())
        answer = front.update(groups[-1], named, version=1)
        assert (answer.version, answer.received_bytes) == (1, sum(t.nbytes for _, t in named))
        assert front.backend.version == 1 and front.backend.info().weight_version == 1

        calls = standin.calls()
        routes = [c["route"] for c in calls]
        # each join leaves the group first (SGLang cannot form a second under the same name)
        assert routes[:4] == ["destroy_weights_update_group", "init_weights_update_group"] * 2
        update_calls = [c for c in calls if c["route"] == "update_weights_from_distributed"]
        assert routes[4:] == ["pause_generation"] + ["update_weights_from_distributed"] * 3 + [
            "update_weight_version", "continue_generation"]
        assert calls[4]["mode"] == "in_place" and calls[4]["body"] == {"mode": "in_place"}
        assert [c["names"] for c in update_calls] == [["a", "b", "c"], ["big"], ["d", "e"]]
        for c in update_calls:
            size = sum(torch.empty(0, dtype=getattr(torch, d)).element_size() * torch.Size(s).numel()
                       for d, s in zip(c["dtypes"], c["shapes"]))
            assert size <= bound or len(c["names"]) == 1
            assert c["paused"] and c["flush_cache"] is False and c["weight_version"] is None
        received = [(n, d, s, h) for c in update_calls for n, d, s, h in zip(c["names"], c["dtypes"], c["shapes"],
                                                                          c["digests"])]
        assert received == [(n, DTYPE_NAMES[t.dtype], list(t.shape), digest(t)) for n, t in named]
        switch = calls[-2]
        assert switch == {"route": "update_weight_version", "paused": True, "new_version": "1",
                          "abort_all_requests": False}

        with pytest.raises(ContractError) as failed:
            front.update(groups[-1], named, version=2)
        assert failed.value.status == 500 and failed.value.type == "engine_error"
        assert "chunk 3 of 3 of version 2 (params[4:6]" in failed.value.message, failed.value.message
        assert "injected by the stand-in" in failed.value.message and "restart the engine" in failed.value.message
        routes = [c["route"] for c in standin.calls()][len(calls):]
        assert routes == ["pause_generation"] + ["update_weights_from_distributed"] * 3 + ["continue_generation"]
        assert front.backend.version == 1  # not switched
    finally:
        for group in groups:
            group.destroy()
        front.close()
        standin.stop()


def test_a_release_before_0_5_6_is_refused(tmp_path):
    """0.5.5's /pause_generation aborts every running request: refused when the front starts, by the version it
    reads from the only info route that release has."""
    standin = StandIn(tmp_path, "0.5.5")
    try:
        front = SGLangBackend(standin.url, "m", facts([]), SGLangSettings(max_model_len=64, max_running_seqs=4))
        with pytest.raises(RuntimeError, match=r"SGLang 0\.5\.5 is older than 0\.5\.6.*sglang>=0\.5\.6"):
            front.inspect_server()
        assert standin.calls() == []
    finally:
        standin.stop()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="SGLang is not installed (no CPU build on PyPI; install `.[sglang]` on a GPU machine)")
def test_conformance_suite_passes_on_sglang(tmp_path):
    import torch

    from pipelinerl.conformance import PASS, format_table, run_suite
    from pipelinerl.engines.client import EngineClient
    from pipelinerl.models.tiny import build_tiny_model
    from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail

    if not torch.cuda.is_available():
        pytest.skip("SGLang is installed but there is no GPU")
    model = build_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2, initializer_range=0.2, seed=1234)
    port = free_port()
    log = tmp_path / "sglang.log"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_process(engine_command(str(model), port, engine="sglang",
                                        extra=["--max-model-len", "1024", "--max-running-seqs", "8"]), log, env=env)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        client.wait_healthy(timeout_s=900, process=proc)
        results = run_suite(client.url, str(model))
        assert all(r.status == PASS for r in results), format_table(results) + "\n" + tail(log, 40)
    finally:
        client.close()
        stop_process(proc, timeout_s=30)


def test_sglang_is_started_again_on_another_port_when_its_port_was_taken(monkeypatch, tmp_path):
    """SGLang binds the port it is given only once its model is loaded: another process may take it meanwhile. The
    first port here is held by this test; the server stand-in cannot bind it and exits, and it is started again
    on a free port, healthy."""
    import socket

    import pipelinerl.engines.sglang as sglang_module

    server = tmp_path / "server.py"
    server.write_text(
        "import sys, http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    ports = iter([held.getsockname()[1]] + [free_port() for _ in range(3)])
    monkeypatch.setattr(sglang_module, "free_port", lambda: next(ports))
    monkeypatch.setattr(sglang_module, "sglang_command", lambda args, port: [sys.executable, str(server), str(port)])
    try:
        proc, url = sglang_module.start_healthy(Namespace(start_timeout_s=30))
        try:
            assert not url.endswith(f":{held.getsockname()[1]}") and httpx.get(url + "/health").status_code == 200
        finally:
            sglang_module.stop_server(proc)
    finally:
        held.close()
