"""The model a run starts from, made ready on node 0 before any engine starts: a tiny model built and warmed up
(cached in `model.path`), or a hub model fetched once into the local cache."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from pipelinerl.config import ConfigError, RunConfig
from pipelinerl.procs import run_in_child


def _task_marker(cfg: RunConfig) -> dict:
    """The task's part of the cached model's marker: what its warm-up data depend on. The arithmetic task's keys
    are those the marker had before the task's settings moved under task.args, so existing caches stay valid."""
    t = cfg.task
    if t.name == "arithmetic":
        from pipelinerl.tasks import task_from_config

        task = task_from_config(t)
        marker = {"name": t.name, "digits": task.digits, "ops": task.ops, "num_train": task.num_train,
                  "seed": task.seed, "reverse": task.reverse}
        if task.mul_digits != type(task).mul_digits:  # (absent at its default, for the same reason)
            marker["mul_digits"] = task.mul_digits
        return marker
    return {"name": t.name, "seed": t.seed, "args": dict(t.args)}


def prepare_model(cfg: RunConfig) -> Path:
    """The model the run starts from. With `model.init: tiny`, build a small model and give it the supervised
    warm-up; both are cached in `model.path` (a marker records the settings) so a rerun skips them."""
    path = Path(cfg.model.path)
    if cfg.model.init != "tiny":
        return path
    m, t = cfg.model, cfg.task
    seed = cfg.seed if m.seed is None else m.seed
    settings = {"seed": seed, "hidden": m.tiny_hidden_size, "layers": m.tiny_layers,
                "warmup_steps": m.warmup_steps, "warmup_lr": m.warmup_lr, "warmup_batch_size": m.warmup_batch_size,
                "task": _task_marker(cfg)}
    if m.tiny_tokenizer != "char":  # (absent for the char tokenizer, so existing caches stay valid)
        settings["tokenizer"] = {"kind": m.tiny_tokenizer, "vocab_size": m.tiny_vocab_size}
    marker = path / "pipelinerl_base_model.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        print(f"using the cached base model in {path}")
        return path
    import torch

    from pipelinerl.models.tiny import build_tiny_model
    from pipelinerl.models.warmup import warm_up_saved_model
    from pipelinerl.tasks import task_from_config

    print(f"building a tiny model in {path} (seed {seed})")
    # built beside the cache and swapped in whole at the end: a build that is stopped or fails (minutes of warm-up
    # on a CPU) leaves the model cached before it, under its own marker, instead of new weights under an old marker
    building = path.with_name(f".{path.name}.building")
    shutil.rmtree(building, ignore_errors=True)
    torch.set_num_threads(max(1, cfg.engine.threads + cfg.trainer.threads))
    task = task_from_config(t)
    target = getattr(task, "target", None)  # the warm-up's supervised answers, where the task has them
    tokenizer = None
    if m.tiny_tokenizer == "bpe":
        from pipelinerl.models.tiny import build_bpe_tokenizer

        texts = [task.prompt(p) + (target(p) if target and m.warmup_steps else "") for p in task.train_problems()]
        tokenizer = build_bpe_tokenizer(texts, m.tiny_vocab_size)
    build_tiny_model(building, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=seed,
                     max_positions=max(1024, cfg.engine.max_model_len), tokenizer=tokenizer)
    if m.warmup_steps > 0:
        if target is None:
            raise ConfigError(f"model.warmup_steps: task {t.name!r} has no supervised targets; set it to 0")
        examples = [(task.prompt(p), target(p)) for p in task.train_problems()]
        args = (str(building), examples, m.warmup_steps, m.warmup_batch_size, m.warmup_lr, seed)
        if torch.cuda.is_available():
            # On GPU 0, before any engine or trainer holds it: seconds where the node's CPU took minutes (float32
            # either way). In a child process, so that this launcher, which lives as long as the run, never holds
            # a CUDA context (memory on GPU 0, and a GPU in exclusive-process mode refused to the trainer).
            print("the supervised warm-up runs on GPU 0")
            run_in_child(warm_up_saved_model, *args, "cuda")
        else:
            warm_up_saved_model(*args)
    (building / marker.name).write_text(json.dumps(settings))
    replace_dir(building, path)
    return path


def fetch_hub_model(cfg: RunConfig) -> RunConfig:
    """`cfg` with a hub name in `model.path` replaced by its local snapshot, fetched once here (node 0's launcher)
    before any engine or trainer process starts, so that none of them downloads it (`pipelinerl.models.hub`)."""
    from pipelinerl.models.hub import is_hub_name

    if cfg.model.init == "tiny" or not is_hub_name(cfg.model.path):
        return cfg
    local = fetch_model(cfg.model.path)
    print(f"model {cfg.model.path}: {local}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(local)))


def fetch_model(name: str) -> Path:
    from pipelinerl.models.hub import fetch_model as fetch

    return fetch(name)


def replace_dir(new: Path, path: Path) -> None:
    """Put directory `new` at `path`, removing what was there. Stopped between its two renames, `path` is missing
    (rebuilt by the next run), never half old and half new."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    new.rename(path)
    shutil.rmtree(old, ignore_errors=True)
