"""A model named on the Hugging Face hub, fetched once into the local cache before any process of a run loads it.

A run whose `model.path` is a hub name ("Qwen/Qwen2.5-7B") would otherwise have every engine and every trainer
process download the same weights at the same time (8 engines x 15 GB for 7B, from 32 processes over 4 nodes for
32B), the usual way shared storage and the hub's rate limits fall over. So the launcher of node 0 fetches it here,
once, into the Hugging Face cache (`HF_HOME`, or `HF_HUB_CACHE`; put it on a filesystem the nodes share), and every
process of the run is given the local directory. `pipelinerl data model NAME` does the same ahead of a run (on a
login node with internet, say); a run then finds it there. Only what serving and training read is fetched: the
config, tokenizer and generation files and the safetensors weights (no `.bin`/`.pth` copies, no `original/`).
"""

from __future__ import annotations

import os
from pathlib import Path

# what an engine and the trainer read; a hub repository often also carries the same weights as .bin, .pth or GGUF
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
IGNORE_PATTERNS = ["original/*", "*.bin", "*.pth", "*.pt", "*.gguf", "*.msgpack", "*.h5"]


def is_hub_name(path: str) -> bool:
    """A hub repository id ("org/name") rather than a local directory: not a path that exists, not written as a
    path (absolute, ./ or ../, ~), one slash."""
    if not path or Path(path).expanduser().exists() or path.startswith(("/", ".", "~")):
        return False
    parts = path.split("/")
    return len(parts) == 2 and all(parts)


def cache_dir() -> Path:
    """Where the hub's files are cached on this machine (huggingface_hub's rule: HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_model(name: str, revision: str | None = None) -> Path | None:
    """The local snapshot of `name` when every file the run needs is in the cache already, else None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    return path if complete(path) else None


def complete(path: Path) -> bool:
    """A snapshot with a config and all the safetensors files its index lists (or one safetensors file)."""
    import json

    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return all((path / shard).is_file() for shard in shards)
    return any(path.glob("*.safetensors"))


class ModelFetchError(RuntimeError):
    pass


def fetch_model(name: str, revision: str | None = None) -> Path:
    """The local snapshot of `name`, downloaded into the cache first where it is not complete there. Offline
    (HF_HUB_OFFLINE=1) only the cache is looked at."""
    cached = cached_model(name, revision)
    if cached is not None:
        return cached
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelFetchError(f"model.path {name!r}: not in the Hugging Face cache ({cache_dir()}) and "
                              f"HF_HUB_OFFLINE=1; fetch it where the hub is reachable (`pipelinerl data model {name}` "
                              "with the same HF_HOME), or set model.path to a local directory")
    from huggingface_hub import snapshot_download

    print(f"fetching {name} from the Hugging Face hub into {cache_dir()} (once, for every process of the run)",
          flush=True)
    try:
        path = Path(snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS))
    except Exception as e:  # network, authentication (a gated model: HF_TOKEN), a wrong name
        raise ModelFetchError(f"model.path {name!r}: could not fetch it from the Hugging Face hub ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); check the name, the network and, for a "
                              "gated model, HF_TOKEN; or set model.path to a local directory") from None
    if not complete(path):
        raise ModelFetchError(f"model.path {name!r}: {path} has no config.json or safetensors weights after the fetch; "
                              "the launcher needs a model in safetensors format")
    return path
