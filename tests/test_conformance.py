"""The conformance suite against the embedded engine (a real server process; this process is the trainer), also
with models that are hard for it (random with tied embeddings, near one-hot, one token whatever the input), and
proof that the suite catches violations."""

import contextlib
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from conftest import running_engine, wait_until
from helpers.conformance_models import build_confident_model, build_fresh_tied_model, build_one_token_model
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipelinerl.cli import main as cli_main
from pipelinerl.conformance import FAIL, PASS, Reference, Settings, Suite, format_table, run_suite
from pipelinerl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    with running_engine(tiny_model_dir, log_dir, extra=["--max-model-len", "1024", "--max-running-seqs", "8",
                                                        "--max-batch-tokens", "8192"]) as client:
        yield client


def test_embedded_engine_passes_every_check(engine, tiny_model_dir):
    results = run_suite(engine.url, str(tiny_model_dir), settings=Settings(in_flight_seconds=2.0))
    table = format_table(results)
    print(table)
    assert [r.name for r in results] == [name for name, _ in Suite.CHECKS]
    assert all(r.status == PASS for r in results), table


def test_suite_catches_an_engine_serving_other_weights(engine, tmp_path):
    # The engine serves the conftest model; rescoring with a differently initialised model must fail.
    other = build_tiny_model(tmp_path / "other", hidden_size=64, num_layers=2, initializer_range=0.2, seed=99)
    results = run_suite(engine.url, str(other), only=["logprobs_greedy", "logprobs_sampled"])
    assert [r.status for r in results] == [FAIL, FAIL], format_table(results)
    assert "rescoring" in results[0].detail


def test_command_line_exit_status_and_table(engine, tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "results.json"
    assert cli_main(["conformance", "--url", engine.url, "--model", str(tiny_model_dir), "--only",
                     "health_info,bad_input", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "health_info" in printed and "PASS" in printed and out_json.exists()
    assert cli_main(["conformance", "--url", engine.url, "--model", str(tiny_model_dir), "--only", "nope"]) == 2


# --- models that are hard for the suite: a correct engine must pass every check with any causal LM -----------

HARD_MODELS = {"fresh_tied": build_fresh_tied_model, "confident": build_confident_model,
               "one_token": build_one_token_model}
ENGINE_ARGS = ["--max-model-len", "1024", "--max-running-seqs", "8", "--max-batch-tokens", "8192"]


@pytest.fixture(scope="module")
def hard_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hard_models")
    return {kind: build(root / kind) for kind, build in HARD_MODELS.items()}


def reference_greedy(ref: Reference, state: dict[str, torch.Tensor], prompt: list[int], steps: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(ref.next_logits(state, prompt + tokens).argmax()))
    return tokens


@pytest.mark.parametrize("kind, negated", [("fresh_tied", ["model.norm.weight"]),
                                           ("confident", ["model.norm.weight"]),
                                           ("one_token", ["lm_head.weight"])],
                         ids=["fresh_tied", "confident", "one_token"])
def test_new_weights_change_the_greedy_tokens_of_any_model(hard_models, kind, negated):
    ref = Reference(str(hard_models[kind]))
    prompt = [20, 31, 42, 53, 9, 17]
    before = reference_greedy(ref, ref.base, prompt, 12)
    if kind != "confident":  # what made the suite fail a correct engine: noise alone changes no greedy token
        assert reference_greedy(ref, ref.perturbed(seed=1), prompt, 12) == before
    assert ref.flip_names == negated
    flipped = ref.flipped(ref.base)
    old = ref.logits(ref.base, prompt, before)
    assert torch.allclose(ref.logits(flipped, prompt, before), -old, atol=1e-5 * float(old.abs().max()))
    # the logits negated: on any context, every greedy token becomes the least likely one under the old weights
    assert (ref.logits(flipped, prompt, before).argmax(-1) == old.argmin(-1)).all()
    assert (old.argmin(-1) != old.argmax(-1)).all()
    (what, noisy_flipped), (_, only_flipped) = ref.changed(seed=1)
    assert only_flipped is not None and "negated" in what
    assert reference_greedy(ref, noisy_flipped, prompt, 12)[0] != before[0]


def test_sampling_temperature_spreads_a_confident_model(hard_models):
    suite = Suite("http://127.0.0.1:9", str(hard_models["confident"]))  # no engine: the rescoring only
    suite.prompt = [20, 31, 42, 53, 9, 17]
    first = torch.softmax(suite.ref.next_logits(suite.ref.base, suite.prompt), -1)
    assert float(first.double().pow(3).sum()) > 0.99  # at temperature 1, three samples are all the same
    temperature, p_same = suite._spread_temperature(3)
    suite.client.close()
    assert 1 < temperature <= 100 and p_same <= 0.05


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(HARD_MODELS))
def test_embedded_engine_passes_every_check_with_a_hard_model(hard_models, kind, tmp_path):
    with running_engine(hard_models[kind], tmp_path, extra=ENGINE_ARGS) as client:
        results = run_suite(client.url, str(hard_models[kind]), settings=Settings(in_flight_seconds=1.5))
    table = format_table(results)
    print(table)
    assert [r.status for r in results] == [PASS] * len(Suite.CHECKS), table


def stale_front(updated: str, stale: str) -> Starlette:
    """A wrong engine made of two real ones: every route goes to `updated` (it joins the group and takes the
    updates) except generation, which `stale` (never updated) serves with the versions `updated` reports (when an
    update lands during a request, its second half is labelled with the new version), one sample copied n
    times."""
    http = httpx.AsyncClient(timeout=600)

    async def version() -> int:
        return (await http.get(f"{updated}/v1/info")).json()["weight_version"]

    async def generate(body: dict) -> Response:
        n = body.setdefault("sampling", {}).get("n", 1)
        body["sampling"]["n"] = 1
        start = await version()
        r = await http.post(f"{stale}/v1/generate", json=body)
        end = await version()
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        out = r.json()
        c = out["completions"][0]
        half = len(c["versions"]) // 2 if end != start else len(c["versions"])
        c["versions"] = [start] * half + [end] * (len(c["versions"]) - half)
        out["completions"] = [c] * n
        return JSONResponse(out)

    async def route(request: Request) -> Response:
        body = await request.body()
        if request.url.path == "/v1/generate":
            return await generate(json.loads(body))
        r = await http.request(request.method, f"{updated}{request.url.path}", content=body,
                               headers={"content-type": "application/json"})
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", route, methods=["GET", "POST"])])


@contextlib.contextmanager
def serving(app: Starlette):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here, so that no other process can take the port before the server
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the front started", timeout_s=30)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.mark.slow
def test_suite_fails_an_engine_that_generates_with_stale_weights_and_copies_samples(hard_models, tmp_path):
    # The model whose greedy output noise alone does not change: the update checks must still tell a stale engine
    model = hard_models["fresh_tied"]
    with running_engine(model, tmp_path, extra=ENGINE_ARGS) as updated, \
            running_engine(model, tmp_path, extra=ENGINE_ARGS) as stale, \
            serving(stale_front(updated.url, stale.url)) as url:
        results = run_suite(url, str(model), only=["generate_fields", "update_changes", "in_flight_update"],
                            settings=Settings(in_flight_seconds=1.0))
    table = format_table(results)
    print(table)
    by_name = {r.name: r for r in results}
    assert by_name["group_init"].status == PASS, table
    assert {n: by_name[n].status for n in ("generate_fields", "update_changes", "in_flight_update")} == \
        {"generate_fields": FAIL, "update_changes": FAIL, "in_flight_update": FAIL}, table
    assert "all identical" in by_name["generate_fields"].detail
    assert "did not change" in by_name["update_changes"].detail
    assert "rescoring" in by_name["in_flight_update"].detail
