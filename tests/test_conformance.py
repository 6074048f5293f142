"""The conformance suite against the embedded engine (a real server process; this process is the trainer), and
proof that the suite catches a violation."""

import pytest
from conftest import running_engine

from pipelinerl.cli import main as cli_main
from pipelinerl.conformance import FAIL, PASS, Settings, Suite, format_table, run_suite
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
