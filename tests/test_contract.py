"""The contract document and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.contracts.openapi import build_openapi, render_openapi

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("args", [[], ["run"], ["serve"], ["eval"], ["plot"], ["conformance"]])
def test_every_subcommand_has_help(args):
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", *args, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage: pipelinerl" in r.stdout
