"""A model named on the Hugging Face hub is fetched once, by node 0's launcher, into the hub's cache, and every
process of the run is given the local directory (pipelinerl/models/hub.py). No hub is reachable here, so the cache
is filled as huggingface_hub fills it (refs/main naming a snapshot folder) and everything runs offline; what is
tested is that nothing but that one lookup ever sees the hub name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.config import load_config
from pipelinerl.models.hub import ModelFetchError, complete, fetch_model, is_hub_name

ROOT = Path(__file__).resolve().parents[1]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, name: str, model_dir: Path) -> Path:
    """`name` in the hub cache at `cache`, as snapshot_download leaves it; returns the snapshot folder."""
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir):
    cache = tmp_path / "hub"
    snapshot = fill_cache(cache, "Org/Tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, snapshot


def test_hub_names_and_local_paths_are_told_apart(tmp_path):
    assert is_hub_name("Qwen/Qwen2.5-7B") and is_hub_name("org/name")
    for local in ("/models/Qwen2.5-7B", "./model", "../m/x", "~/m", "a/b/c", "model", ""):
        assert not is_hub_name(local), local
    (tmp_path / "org").mkdir()
    os.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_name("org/name")  # a local directory that looks like a name is a directory


def test_a_cached_model_resolves_to_its_snapshot_offline(hub_cache):
    _, snapshot = hub_cache
    assert fetch_model("Org/Tiny") == snapshot
    with pytest.raises(ModelFetchError, match=r"not in the Hugging Face cache .*`pipelinerl data model Org/Other`"):
        fetch_model("Org/Other")


def test_a_snapshot_missing_a_shard_is_not_taken_for_the_model(hub_cache):
    _, snapshot = hub_cache
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert not complete(snapshot)
    with pytest.raises(ModelFetchError, match="not in the Hugging Face cache"):
        fetch_model("Org/Tiny")  # offline: it would be fetched (again) where the hub is reachable


def test_the_launcher_gives_every_process_the_local_copy(hub_cache, tmp_path):
    from pipelinerl.launch import fetch_hub_model

    _, snapshot = hub_cache
    cfg = load_config(ROOT / "recipes/tiny_cpu.yaml", [f"run_dir={tmp_path / 'run'}", "model.init=pretrained",
                                                       "model.path=Org/Tiny"])
    assert fetch_hub_model(cfg).model.path == str(snapshot)


@pytest.mark.slow
def test_a_run_of_a_hub_model_loads_it_from_the_cache_in_every_process(hub_cache, tmp_path):
    """A whole run, offline: the engine's command and the trainer's config carry the snapshot folder."""
    cache, snapshot = hub_cache
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", "recipes/tiny_cpu.yaml",
                           f"run_dir={run_dir}", "model.init=pretrained", "model.path=Org/Tiny",
                           "trainer.max_steps=2", "trainer.eval_every=0", "sampling.max_new_tokens=8",
                           "engine.max_model_len=64", "trainer.micro_batch_tokens=256",
                           "actor.dynamic_sampling=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model Org/Tiny: {snapshot}" in done.stdout
    assert load_config(run_dir / "config.yaml").model.path == str(snapshot)
    assert f"serving {snapshot}" in (run_dir / "logs" / "engine0.log").read_text()
