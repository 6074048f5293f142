"""Checkpoints that resume a run exactly, and Hugging Face exports that any engine can load.

A checkpoint directory holds what `accelerator.save_state` writes (model, optimizer, the LR scheduler
registered by the trainer, RNG states of python/numpy/torch per process; sharded the DeepSpeed/FSDP way when
the model is sharded), the KL reference model when there is one, and `trainer_state.json` (version, step,
the reference-reset clock and the caller's opaque `data_position`).

Atomic: everything is written into `.tmp-<name>` beside the target and renamed into place at the end, so a
crash leaves either the previous checkpoint or the new one, never half of one. `latest_checkpoint` only
considers complete directories.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_model, save_model

from pipelinerl.trainer.ranks import host_barrier
from pipelinerl.trainer.trainer import Trainer, zero3_hidden_from_transformers

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
REFERENCE_FILE = "reference.safetensors"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps lives: `<run_dir>/checkpoints/step_00000042`."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(trainer: Trainer, ckpt_dir: str | os.PathLike,
                    data_position: dict[str, Any] | None = None) -> Path:
    """Save everything needed to continue after the last optimizer step. Every trainer rank calls it."""
    final = Path(ckpt_dir)
    tmp = final.parent / f".tmp-{final.name}"
    acc = trainer.accelerator
    # The processes meet between the phases at the host barrier (ranks.py), not in a collective: writing files
    # takes as long as the filesystem takes, and the main process writes more than the others.
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    host_barrier(f"making {tmp}")
    acc.save_state(str(tmp))
    # every rank has written its files (its RNG state, its shard) before the main process renames the directory
    # away from under them
    host_barrier(f"writing the checkpoint shards into {tmp}")
    if acc.is_main_process:
        if trainer.ref_model is not None:
            save_model(trainer.ref_model, str(tmp / REFERENCE_FILE))
        state = {**trainer.state_dict(), "data_position": data_position or {}}
        _write_json(tmp / STATE_FILE, state)
        _replace_dir(tmp, final)
    host_barrier(f"writing checkpoint {final}")
    log.info("saved checkpoint %s (version %d)", final, trainer.version)
    return final


def load_checkpoint(trainer: Trainer, ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Restore a trainer built with the same config from `ckpt_dir`; returns the saved `data_position`."""
    src = Path(ckpt_dir)
    if not (src / STATE_FILE).is_file():
        raise FileNotFoundError(f"{src} is not a complete checkpoint (no {STATE_FILE})")
    state = json.loads((src / STATE_FILE).read_text())
    trainer.accelerator.load_state(str(src))
    if trainer.fused_adamw:  # loading replaces the param groups: one saved before AdamW was fused says None
        critic = trainer.critic.optimizer if trainer.critic is not None else None
        for optimizer in filter(None, (trainer.optimizer, critic)):
            for group in optimizer.param_groups:
                group["fused"] = True
    trainer.load_state_dict(state)
    if trainer.ref_model is not None:
        if (src / REFERENCE_FILE).is_file():
            load_model(trainer.ref_model, str(src / REFERENCE_FILE))
        else:  # saved without a KL penalty: the policy at resume becomes the reference
            log.warning("%s has no reference model; using the restored policy as the KL reference", src)
            trainer.reset_reference()
    log.info("resumed from %s at version %d, step %d", src, trainer.version, trainer.step)
    return state["data_position"]


def _complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, str, Path]]:
    """(step, name, directory) of every complete checkpoint under `<run_dir>/checkpoints`, oldest first; saves
    under way (`.tmp-`, `.old-`) and unreadable directories are left out."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not (d / STATE_FILE).is_file():
            continue
        try:
            found.append((int(json.loads((d / STATE_FILE).read_text())["step"]), d.name, d))
        except (OSError, ValueError, KeyError):
            log.warning("ignoring %s: unreadable %s", d, STATE_FILE)
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `<run_dir>/checkpoints`, or None."""
    complete = _complete_checkpoints(run_dir)
    return complete[-1][2] if complete else None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `<run_dir>/checkpoints` (0 keeps all); returns
    what was deleted. Main process only."""
    if keep <= 0:
        return []
    deleted = [d for _, _, d in _complete_checkpoints(run_dir)[:-keep]]
    for d in deleted:
        shutil.rmtree(d, ignore_errors=True)
    return deleted


def export_hf(trainer: Trainer, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write the full current model with `save_pretrained` (weights in the engines' dtype), plus the tokenizer
    (the one given, else the one beside the trainer's model if there is one). Every trainer rank calls it."""
    # collective when sharded; gathered one unit at a time into CPU memory, never the whole model on a GPU
    named = dict(trainer.full_parameters(device="cpu"))
    out = Path(out_dir)
    if trainer.accelerator.is_main_process:
        tmp = out.parent / f".tmp-{out.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        model = trainer.unwrapped_model
        with zero3_hidden_from_transformers():
            model.save_pretrained(tmp, state_dict=named, safe_serialization=True)
        config = copy.deepcopy(model.config)
        config.dtype = trainer.weights_dtype
        config.use_cache = True  # the trainer turned it off; engines want it
        config.save_pretrained(tmp)
        if tokenizer is None:
            tokenizer = _tokenizer_beside(trainer.model_path)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out)
    host_barrier(f"writing the export {out}")  # the main process wrote the whole model alone
    return out


def _tokenizer_beside(model_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # a bare model directory: engines can still serve token ids
        return None


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    """Move `src` to `dst`, replacing an existing `dst`; the final rename is the commit point."""
    old = dst.parent / f".old-{dst.name}"
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
