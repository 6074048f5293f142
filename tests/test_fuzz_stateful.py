"""The stateful fuzzer (tests/helpers/stateful_fuzz.py) against the embedded engine, with an API key, this process as
its trainer: a short walk in `make test`; `make fuzz` walks for long (PIPELINERL_FUZZ_STEPS, PIPELINERL_FUZZ_SEED)."""

from __future__ import annotations

import os

import pytest
from conftest import running_engine
from helpers.stateful_fuzz import fuzz

from pipelinerl.engines.client import EngineClient

pytestmark = pytest.mark.slow
STEPS = int(os.environ.get("PIPELINERL_FUZZ_STEPS", "150"))
SEED = int(os.environ.get("PIPELINERL_FUZZ_SEED", "0"))
KEY = "stateful-fuzz-key"


@pytest.fixture
def keyed_env(monkeypatch):
    monkeypatch.setenv("PIPELINERL_API_KEY", KEY)  # the engine requires it, and the clients send it


# the thread receiver is walked only in `make fuzz`: it shares every code path but the receiving process
@pytest.mark.parametrize("receiver", ["process", "thread"] if "PIPELINERL_FUZZ_STEPS" in os.environ else ["process"])
def test_stateful_walk_keeps_the_contract(tiny_model_dir, tmp_path, keyed_env, receiver):
    extra = ["--max-model-len", "64", "--max-running-seqs", "8", "--update-receiver", receiver]
    with running_engine(tiny_model_dir, tmp_path, extra=extra) as client:
        assert EngineClient(client.url, api_key="wrong").health()  # health needs no key; the rest do:
        unauthorized = EngineClient(client.url, api_key="wrong")
        with pytest.raises(Exception, match="401"):
            unauthorized.info()
        tally = fuzz(client, str(tiny_model_dir), SEED + (receiver == "thread"), STEPS)
    assert tally.steps == STEPS and tally.requests >= STEPS
    # the walk reached every kind of step
    ops = {op for op, _ in tally.statuses}
    assert {"generate", "generate_bad", "update", "update_refused", "join_bad", "abort"} <= ops, tally.summary()
