"""Every bad argument of every command ends in one line naming the argument and what to do, and a non-zero exit:
never a traceback from a library (`pipelinerl serve --model /nonexistent` ended in transformers' "Repo id must use
alphanumeric chars")."""

from __future__ import annotations

import os

import pytest
from conftest import run_cli

CASES = [
    (["serve", "--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["serve", "--model", "/tmp"], "--model /tmp: the directory has no config.json"),
    (["serve", "--model", "pipelinerl/cli.py"], "--model pipelinerl/cli.py: a file, not a model directory"),
    (["serve", "--model", "x", "--max-model-len", "0"], "argument --max-model-len: must be at least 1"),
    (["serve", "--model", "x", "--port", "70000"], "argument --port: must be a TCP port"),
    (["serve", "--model", "x", "--threads", "two"], "argument --threads: must be an integer, got 'two'"),
    (["serve", "--model", "x", "--start-timeout-s", "-1"], "argument --start-timeout-s: must be a finite number"),
    (["serve", "--model", "Org/NotCached"], "--model Org/NotCached: model.path 'Org/NotCached': not in the Hugging"),
    (["eval", "--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["conformance", "--url", "nope", "--model", "/tmp"], "--url 'nope': must be an engine's base URL"),
    (["conformance", "--url", "http://127.0.0.1:1", "--model", "/nonexistent"], "--model /nonexistent"),
    (["run", "nope.yaml"], "recipe 'nope.yaml' does not exist"),
    (["run", "recipes/tiny_cpu.yaml", "--fast"], "unknown option --fast"),
    (["run", "recipes/tiny_cpu.yaml", "trainer.lr=-1"], "trainer.lr: must be > 0"),
    (["plan", "nope.yaml"], "recipe 'nope.yaml' does not exist"),
    (["data", "model", "nothing"], "give a Hugging Face model name"),
    (["data", "orz", "extra"], "takes no name"),
    (["plot", "/nonexistent"], "/nonexistent/metrics.jsonl does not exist"),
]


@pytest.mark.parametrize("argv, says", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_argument_is_one_line_naming_it(argv, says):
    done = run_cli(argv, timeout_s=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if says in line]
    assert len(lines) == 1, done.stderr
