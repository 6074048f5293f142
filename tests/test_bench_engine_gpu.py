"""bench/engine_gpu.py: it says why it cannot run without a GPU, and its measurement (the same code a GPU runs,
with the device named) times both sides on a small model here."""

from __future__ import annotations

import pytest
import torch

from bench import engine_gpu
from bench.common import tiny_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark runs there")
def test_without_a_gpu_the_benchmark_reports_itself_skipped():
    result = engine_gpu.run(quick=True)
    assert result["skipped"] and "needs a GPU" in result["skipped"] and result["ratio"] is None


def test_the_measurement_times_the_engine_and_hf_generate_per_decode_step(tmp_path):
    path = tiny_model(tmp_path, hidden_size=32, num_layers=2)
    # 64 decode steps between the two lengths: well above a loaded machine's noise, for a step of ~0.2 ms
    result = engine_gpu.measure(path, "cpu", batches=(1, 4), lengths=(4, 68))
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["engine_ms"] > 0 and row["hf_ms"] > 0, row
        assert row["engine_over_hf"] == pytest.approx(row["hf_ms"] / row["engine_ms"], rel=0.02), row
    assert result["ratio"] == min(r["engine_over_hf"] for r in result["rows"])
    assert result["gpu_busy"] is None and result["passed"] == (result["ratio"] >= engine_gpu.TARGET)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_the_profiled_decode_counts_no_gpu_kernels_on_a_cpu(tmp_path):
    """The profiler part runs on a CPU too, where nothing is launched on a GPU: the counts are zero, not an error."""
    from bench.engine_scale import EngineSide
    from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings
    from pipelinerl.engines.embedded.serve import load_model

    path = tiny_model(tmp_path, hidden_size=32, num_layers=2)
    model, tokenizer = load_model(str(path), "float32", "cpu")
    engine = EmbeddedEngine(model, str(path), EngineSettings(max_running_seqs=4, max_model_len=256))
    side = EngineSide(engine, engine_gpu._prompts(4, len(tokenizer)))
    try:
        got = engine_gpu._gpu_busy(side, "cpu")
    finally:
        side.close()
        engine.shutdown()
    assert got == {"gpu_busy": 0.0, "kernel_ms_per_step": 0.0, "kernels_per_step": 0.0}
