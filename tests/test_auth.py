"""The API key: every engine route but /v1/health needs it when the engine has one; an engine reachable from other
hosts does not start without one; a run makes its own key, hands it to its processes, and never prints it."""

import os
import stat

import httpx
import pytest
from conftest import run_cli, running_engine

from pipelinerl.auth import API_KEY_ENV, authorized, run_api_key
from pipelinerl.contracts.inference import GenerateRequest, SamplingParams

KEY = "k3y-for-tests-0123456789abcdef"


def test_routes_need_the_key_and_health_does_not(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the engine and the test's EngineClient read it
    with running_engine(tiny_model_dir, tmp_path) as client:
        url = client.url
        assert httpx.get(f"{url}/v1/health").status_code == 200
        version = client.info().weight_version  # the client sends the key from the environment
        for method, path, body in (("GET", "/v1/info", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/generate", {"prompt_token_ids": [1, 2]}),
                                   ("POST", "/v1/abort", {}),
                                   ("POST", "/v1/weights/init_group", {"master_address": "10.9.9.9",
                                                                       "master_port": 1, "rank_offset": 1,
                                                                       "world_size": 2, "backend": "gloo",
                                                                       "group_name": "evil"}),
                                   ("POST", "/v1/weights/update", {"version": version + 1, "tensors": []}),
                                   ("GET", "/v1/weights/checksum", None), ("GET", "/openapi.json", None)):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
        r = httpx.get(f"{url}/v1/info", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["weight_version"] == version  # no update reached the weights
        out = client.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True)  # sampled: EOS could end it early
        assert len(out.completions[0].token_ids) == 3
        log = client.log_path.read_text()
    assert KEY not in log and "API key required" in log


def test_a_reachable_engine_without_a_key_refuses_to_start(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    cmd = ["serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0"]
    r = run_cli(cmd, env=env)
    assert r.returncode != 0 and "refusing to serve on 0.0.0.0 without an API key" in r.stderr
    empty = tmp_path / "empty_key"
    empty.write_text("\n")
    r = run_cli([*cmd, "--api-key-file", str(empty)], env=env)
    assert r.returncode != 0 and "is empty" in r.stderr


def test_the_run_key_is_made_once_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    key = run_api_key(tmp_path)
    assert len(key) >= 32 and run_api_key(tmp_path) == key
    assert stat.S_IMODE((tmp_path / "api_key").stat().st_mode) == 0o600
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert run_api_key(tmp_path / "other") == "from-env" and not (tmp_path / "other").exists()


@pytest.mark.parametrize("header, ok", [(f"Bearer {KEY}", True), (f"bearer {KEY}", True), (KEY, False),
                                        (f"Bearer {KEY}x", False), ("Bearer ", False), (None, False),
                                        (f"Basic {KEY}", False)])
def test_authorized(header, ok):
    assert authorized(header, KEY) is ok


def test_requests_with_the_key_are_served(tiny_model_dir, tmp_path, monkeypatch):
    """The async client (the actor's) sends the key too."""
    import asyncio

    from pipelinerl.engines.client import AsyncEngineClient

    monkeypatch.setenv(API_KEY_ENV, KEY)
    with running_engine(tiny_model_dir, tmp_path) as client:
        async def go():
            c = AsyncEngineClient(client.url)
            try:
                req = GenerateRequest(prompt_token_ids=[4, 5], sampling=SamplingParams(max_new_tokens=2))
                return await c.generate(req)
            finally:
                await c.aclose()

        assert len(asyncio.run(go()).completions[0].token_ids) == 2
