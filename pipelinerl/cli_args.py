"""Argument types and checks shared by the commands: every bad argument is one line naming it and what to do, and
a non-zero exit, never a traceback from deep inside a library (transformers' "Repo id must use alphanumeric chars"
for a model directory that is not there)."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), or 0 for any free one, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def model_directory(value: str, flag: str = "--model") -> str:
    """The local model directory `value` names: itself, or for a Hugging Face name its snapshot in the hub cache
    (fetched there first if need be). Exits with one line naming `flag` when it is neither."""
    from pipelinerl.models.hub import ModelFetchError, fetch_model, is_hub_name

    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SystemExit(f"{flag} {value}: a file, not a model directory (a Hugging Face model's folder, with "
                             "its config.json)")
        if not (path / "config.json").is_file():
            raise SystemExit(f"{flag} {value}: the directory has no config.json, so it holds no Hugging Face model; "
                             "point it at the model's folder (save_pretrained's output)")
        return str(path)
    if is_hub_name(value):
        try:
            return str(fetch_model(value))
        except ModelFetchError as e:
            raise SystemExit(f"{flag} {value}: {e}") from None
    raise SystemExit(f"{flag} {value}: no such directory, and not a Hugging Face model name (Org/Model); give a "
                     "local model directory or a hub name")
