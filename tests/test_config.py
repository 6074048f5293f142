"""Configuration: defaults <- recipe YAML <- dotted overrides, and clear errors naming the key and source."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelinerl.config import ConfigError, RunConfig, load_config, save_resolved_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def write(tmp_path, text, name="recipe.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_recipe_merges_onto_defaults_and_overrides_win(tmp_path):
    recipe = write(tmp_path, "run_dir: runs/x\nmodel:\n  path: /models/tiny\ntrainer:\n  lr: 3.0e-5\n")
    cfg = load_config(recipe, ["trainer.lr=1e-6", "trainer.betas=[0.9,0.95]", "actor.max_lag=0"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.betas == [0.9, 0.95] and cfg.actor.max_lag == 0
    assert cfg.model.path == "/models/tiny" and cfg.engine.host == "127.0.0.1"  # untouched default


@pytest.mark.parametrize("text, overrides, needles", [
    ("run_dir: a\nmodel: {path: m}\ntrainer: {lrr: 1}\n", [], ["trainer.lrr", "recipe.yaml"]),
    ("run_dir: a\nmodel: {path: m}\n", ["trainer.nope=1"], ["trainer.nope", "command line"]),
    ("run_dir: a\nmodel: {path: m}\ntrainer: {lr: fast}\n", [], ["trainer.lr", "recipe.yaml", "fast"]),
    ("run_dir: a\nmodel: {path: m}\n", ["trainer.max_steps=many"], ["trainer.max_steps", "command line"]),
    ("run_dir: a\nmodel: {path: m}\n", ["weight_sync.backend=mpi"], ["weight_sync.backend", "gloo"]),
    ("run_dir: a\nmodel: {path: m}\n", ["streams.backend=kafka"], ["streams.backend", "files, redis"]),
    ("run_dir: a\nmodel: {path: m}\n", ["streams.redis_url=localhost:6379"], ["streams.redis_url", "redis://"]),
    ("run_dir: a\nmodel: {path: m}\n", ["trainer.lr=-1"], ["trainer.lr", "> 0"]),
    ("run_dir: a\nmodel: {path: m}\n", ["trainer.export_every=-1"], ["trainer.export_every", ">= 0"]),
    ("run_dir: a\n", [], ["model.path", "missing"]),
    ("model: {path: m}\n", [], ["run_dir", "missing"]),
    ("run_dir: a\nmodel: {path: m}\n", ["trainer.lr"], ["trainer.lr", "key=value"]),
    ("run_dir: [unclosed\n", [], ["recipe.yaml", "YAML"]),
])
def test_bad_config_fails_naming_the_key_and_source(tmp_path, text, overrides, needles):
    recipe = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_is_written_and_reloads_identically(tmp_path):
    recipe = write(tmp_path, "run_dir: a\nmodel: {path: m}\nsampling: {group_size: 4}\n")
    cfg = load_config(recipe, ["engine.num_engines=2"])
    out = save_resolved_config(cfg, tmp_path / "run")
    data = yaml.safe_load(out.read_text())
    assert data["sampling"]["group_size"] == 4 and data["engine"]["num_engines"] == 2
    assert load_config(out) == cfg


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load(recipe):
    load_config(recipe, ["run_dir=/tmp/x", "model.path=/tmp/m"])


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    recipe = write(tmp_path, "run_dir: a\nmodel: {path: m}\ntrainer: {lrr: 1}\n")
    r = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", str(recipe)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "trainer.lrr" in r.stderr and "Traceback" not in r.stderr


SGLANG = ["engine.kind=sglang", "resources.gpus_per_node=8"]


@pytest.mark.parametrize("overrides, key", [
    (["weight_sync.bucket_mb=512"], "weight_sync.bucket_mb"),
    (["weight_sync.backend=gloo"], "weight_sync.backend"),
    (["engine.colocate_with_trainer=true"], "engine.colocate_with_trainer"),
    (["resources.gpus_per_node=0"], "engine.kind"),
    (["weight_sync.sglang_update_chunk_mb=0"], "weight_sync.sglang_update_chunk_mb"),
])
def test_settings_sglang_cannot_take_fail_naming_the_key(tmp_path, overrides, key):
    recipe = write(tmp_path, "run_dir: a\nmodel: {path: m}\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe, SGLANG + overrides)
    message = str(err.value)
    assert f"{key}:" in message and "sglang" in message.lower(), message


def test_an_unset_bucket_size_is_the_engines_format(tmp_path):
    """Unset, weight_sync.bucket_mb is 0 for SGLang (one tensor per broadcast) and 4 MB for the others; set, it
    is kept (0 is what SGLang takes)."""
    recipe = write(tmp_path, "run_dir: a\nmodel: {path: m}\n")
    assert load_config(recipe, SGLANG).weight_sync.bucket_mb == 0
    assert load_config(recipe, ["engine.kind=vllm"]).weight_sync.bucket_mb == 4.0
    assert load_config(recipe, SGLANG + ["weight_sync.bucket_mb=0"]).weight_sync.bucket_mb == 0
    assert load_config(recipe, ["weight_sync.bucket_mb=16"]).weight_sync.bucket_mb == 16


def test_model_seed_keeps_the_cached_base_model_for_a_run_with_another_seed(tmp_path):
    from safetensors.torch import load_file

    from pipelinerl.launch import prepare_model

    base = tmp_path / "base_model"
    settings = [f"run_dir={tmp_path}", f"model.path={base}", "model.warmup_steps=0", "model.tiny_hidden_size=32"]
    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", [*settings, "seed=0"]))
    weights = load_file(base / "model.safetensors")

    # another run seed with model.seed naming the base model's: the cache is used as it is
    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", [*settings, "seed=1", "model.seed=0"]))
    kept = load_file(base / "model.safetensors")
    assert all(kept[k].equal(weights[k]) for k in weights)

    # another run seed alone: a base model of its own seed (different random weights)
    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", [*settings, "seed=1"]))
    rebuilt = load_file(base / "model.safetensors")
    assert any(not rebuilt[k].equal(weights[k]) for k in weights)


def test_a_base_model_build_killed_midway_leaves_the_cached_model_as_it_was(tmp_path):
    """A rebuild (here: other warm-up settings) killed during its warm-up keeps the previous model and marker, so a
    run with the previous settings still uses them, and a rerun with the new ones builds the model whole."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from pipelinerl.launch import prepare_model

    base = tmp_path / "base_model"
    settings = [f"run_dir={tmp_path}", f"model.path={base}", "model.tiny_hidden_size=32", "model.warmup_steps=2"]
    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", settings))
    weights = load_file(base / "model.safetensors")
    marker = (base / "pipelinerl_base_model.json").read_text()

    longer = [*settings, "model.warmup_steps=100000"]
    script = ("import sys; from pipelinerl.config import load_config; from pipelinerl.launch import prepare_model; "
              f"prepare_model(load_config({str(RECIPES / 'tiny_cpu.yaml')!r}, sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", script, *longer], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    building = tmp_path / ".base_model.building"
    try:
        deadline = time.monotonic() + 120
        while not (building / "model.safetensors").exists():  # the new model is written; its warm-up runs
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the rebuild never wrote its model"
            time.sleep(0.05)
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    kept = load_file(base / "model.safetensors")
    assert all(kept[k].equal(weights[k]) for k in weights)
    assert (base / "pipelinerl_base_model.json").read_text() == marker
    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", settings))  # the cache, as it was
    assert all(load_file(base / "model.safetensors")[k].equal(weights[k]) for k in weights)

    prepare_model(load_config(RECIPES / "tiny_cpu.yaml", [*settings, "model.warmup_steps=3"]))
    assert json.loads((base / "pipelinerl_base_model.json").read_text())["warmup_steps"] == 3
    assert any(not load_file(base / "model.safetensors")[k].equal(weights[k]) for k in weights)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left beside it


def test_the_warm_up_in_a_child_process_gives_the_model_of_the_warm_up_in_this_one(tmp_path):
    """On a GPU node the launcher warms the base model up in a spawned child (so that it never holds a CUDA context
    itself). The child's warm-up is the same deterministic training: run on the CPU here, both give the same
    weights bit for bit, and a failure in the child is raised in the parent."""
    import shutil

    import pytest
    from safetensors.torch import load_file

    from pipelinerl.launch import prepare_model
    from pipelinerl.models.warmup import warm_up_saved_model
    from pipelinerl.procs import run_in_child
    from pipelinerl.tasks import task_from_config

    cfg = load_config(RECIPES / "tiny_cpu.yaml", [f"run_dir={tmp_path}", f"model.path={tmp_path}/here",
                                                  "model.warmup_steps=0", "model.tiny_hidden_size=32"])
    prepare_model(cfg)  # the untrained base model
    shutil.copytree(tmp_path / "here", tmp_path / "child")
    initial = load_file(tmp_path / "here" / "model.safetensors")
    task = task_from_config(cfg.task)
    args = ([(task.prompt(p), task.target(p)) for p in task.train_problems()], 6, 16, 3e-3, 0)

    warm_up_saved_model(str(tmp_path / "here"), *args)
    run_in_child(warm_up_saved_model, str(tmp_path / "child"), *args, "cpu")

    here = load_file(tmp_path / "here" / "model.safetensors")
    child = load_file(tmp_path / "child" / "model.safetensors")
    assert any(not here[k].equal(initial[k]) for k in initial), "the warm-up changed nothing"
    assert here.keys() == child.keys() and all(here[k].equal(child[k]) for k in here)
    with pytest.raises(OSError):  # no model there: transformers' error, raised in this process
        run_in_child(warm_up_saved_model, str(tmp_path / "missing"), *args, "cpu")
