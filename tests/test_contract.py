"""The contract document and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.contracts.openapi import build_openapi, render_openapi
from pipelinerl.contracts.routes import create_app, error_response

ROOT = Path(__file__).resolve().parents[1]


def test_committed_config_reference_equals_generated():
    from pipelinerl.config_reference import REFERENCE, render

    assert REFERENCE.read_text() == render(), "docs/config_reference.md is stale: run `make config-reference`"
    text = render()
    for key in ("`trainer.critic.lr`", "`engine.kind`", "`actor.max_lag`", "`task.reward_fn`"):  # nested sections too
        assert key in text


def test_committed_openapi_equals_generated():
    committed = (ROOT / "contracts" / "openapi.json").read_text()
    assert committed == render_openapi(), "contracts/openapi.json is stale: run `make openapi` and commit it"


def test_contract_covers_the_required_operations():
    doc = build_openapi()
    paths = set(doc["paths"])
    for path in ("/v1/generate", "/v1/weights/init_group", "/v1/weights/update", "/v1/abort", "/v1/health",
                 "/v1/info", "/metrics", "/v1/completions"):
        assert path in paths
    schemas = doc["components"]["schemas"]
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop", "n", "seed"} <= set(
        schemas["SamplingParams"]["properties"])
    stop = schemas["SamplingParams"]["properties"]["stop"]
    assert stop["maxItems"] == 16 and stop["items"] == {"type": "string", "minLength": 1, "maxLength": 256}
    assert "stop" in schemas["CompletionsRequest"]["properties"]
    assert {"token_ids", "logprobs", "versions", "finish_reason"} <= set(schemas["Completion"]["properties"])
    assert {"master_address", "master_port", "rank_offset", "world_size", "backend", "group_name"} <= set(
        schemas["InitWeightUpdateGroupRequest"]["properties"])
    assert {"version", "params"} <= set(schemas["UpdateWeightsRequest"]["properties"])
    assert json.loads(render_openapi()) == doc


def test_every_documented_error_is_the_envelope():
    """Errors are `ErrorResponse` on every route; FastAPI's own 422 (never returned: bad input is a 400) is not
    documented; the routes that may answer 501 or 504 say so."""
    doc = build_openapi()
    assert not {"HTTPValidationError", "ValidationError"} & set(doc["components"]["schemas"])
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for status, response in responses.items():
                if not status.startswith("2"):
                    assert response["content"]["application/json"]["schema"] == envelope, (method, path, status)
            if "requestBody" in operation:
                assert {"400", "4XX", "500"} <= set(responses), (method, path)
    for path in ("/v1/weights/init_group", "/v1/weights/update"):
        assert "504" in doc["paths"][path]["post"]["responses"]
    assert "501" in doc["paths"]["/v1/weights/checksum"]["get"]["responses"]


def test_completions_document_what_openai_clients_send():
    """`prompt` and `stop` as OpenAI's clients send them: one string or a list (`stop` also null)."""
    properties = build_openapi()["components"]["schemas"]["CompletionsRequest"]["properties"]
    text = {"type": "string", "minLength": 1, "maxLength": 2**22}
    assert properties["prompt"]["anyOf"] == [text, {"type": "array", "items": text, "minItems": 1,
                                                    "maxItems": 1024}]
    stop = {"type": "string", "minLength": 1, "maxLength": 256}
    assert properties["stop"]["anyOf"] == [stop, {"type": "array", "items": stop, "maxItems": 16}, {"type": "null"}]


def test_middleware_plugs_in_and_errors_stay_the_envelope():
    """The app factory's extension point (what authentication will use): middleware given to `create_app` runs
    before every route and answers with `error_response`; the routes' own errors are unchanged behind it."""
    from fastapi.testclient import TestClient
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    class NeedsKey(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):
            if request.headers.get("x-key") != "k":
                return error_response(401, "unauthorized", "x-key: missing or wrong", "x-key")
            return await call_next(request)

    with TestClient(create_app(None, middleware=[Middleware(NeedsKey)])) as client:
        refused = client.get("/v1/health")
        assert refused.status_code == 401 and refused.json()["error"]["field"] == "x-key"
        behind = client.get("/v1/health", headers={"x-key": "k"})  # no engine behind this app: its own 501
        assert behind.status_code == 501 and behind.json()["error"]["type"] == "not_implemented"
        missing = client.get("/v1/nowhere", headers={"x-key": "k"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize("args", [[], ["run"], ["serve"], ["eval"], ["plot"], ["conformance"]])
def test_every_subcommand_has_help(args):
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", *args, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage: pipelinerl" in r.stdout
