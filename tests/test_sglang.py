"""SGLang behind the contract. The conformance run needs SGLang installed (a GPU build: there is no CPU build on
PyPI) and skips otherwise; the version-span parsing the front relies on is checked everywhere."""

import importlib.util
import os
from pathlib import Path

import pytest

from pipelinerl.engines.common import versions_from_spans
from pipelinerl.engines.sglang.front import _span

ROOT = Path(__file__).resolve().parents[1]


def test_weight_version_spans_become_per_token_versions():
    assert [_span(s) for s in ({"version": "3", "start": 0, "end": 2}, ["4", 2, 5], {"version": "default"})] == [
        (3, 0, 2), (4, 2, 5), None]
    assert versions_from_spans([(3, 0, 2), (4, 2, 5)], 5, fallback=0) == [3, 3, 4, 4, 4]
    # tokens no span covers take the version before them; no spans at all: the fallback
    assert versions_from_spans([(3, 0, 2)], 4, fallback=1) == [3, 3, 3, 3]
    assert versions_from_spans(None, 3, fallback=7) == [7, 7, 7]


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
