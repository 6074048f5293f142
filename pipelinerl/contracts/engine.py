"""What the rest of the project knows of an engine kind (`engine.kind`), as one object per kind.

`serve`, the launcher, `plan` and the config ask the kind instead of branching on its name, so an engine of your
own is one package exporting an `EngineKind` (registered in `pipelinerl.plugins.ENGINES`, or named in the recipe
as `engine.kind: my_engine.kind:KIND`) and speaking the inference contract (`pipelinerl.contracts.inference`).
Everything here is plain data and functions of the config: nothing of an engine is imported until it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from pipelinerl.config import RunConfig


@dataclass(frozen=True)
class EngineKind:
    name: str
    # "module:function" serving the contract with serve's parsed arguments until stopped (`pipelinerl serve
    # --engine NAME`); imported only in the engine's process
    serve: str
    # the Python package the engine runs on, imported by the launcher's preflight before anything starts; None:
    # nothing beyond pipelinerl's own
    package: str | None = None
    # why this venv cannot run the engine on a machine with GPUs (True) or without, with the command that fixes
    # it; None when it can. Read from installed metadata, without importing the engine
    install_problem: Callable[[bool], str | None] | None = None
    # the engine's share of its GPU (engine.gpu_memory_utilization): the environment variable carrying the
    # engine's own arguments, and its flag for that share; None: sized by engine.max_batch_tokens instead
    gpu_memory_flag: tuple[str, str] | None = None
    tensor_parallel: bool = False  # engine.tensor_parallel_size > 1 possible
    default_bucket_mb: float = 4.0  # weight_sync.bucket_mb when the recipe leaves it unset
    # environment variables of the engine's process, from the run's config
    launch_env: Callable[[RunConfig], dict[str, str]] | None = None
    # checks of the config this engine needs beyond the general ones: raise pipelinerl.config.ConfigError naming
    # the key
    check_config: Callable[[RunConfig], None] | None = None
    # bytes of GPU memory the engine holds besides weights and KV to receive an update (plan), and what decides it
    staging_bytes: Callable[[Any, int], tuple[int, str]] | None = None

    def run(self, args: argparse.Namespace) -> None:
        from pipelinerl.plugins import import_ref

        import_ref(self.serve, f"engine kind {self.name}'s serve")(args)


def engine_kind(name: str) -> EngineKind:
    """The kind `engine.kind` names (registered, or a package.module:attr path to an EngineKind)."""
    from pipelinerl.plugins import ENGINES

    kind = ENGINES.get(name)
    if not isinstance(kind, EngineKind):
        raise TypeError(f"engine kind {name!r} is {kind!r}, not a pipelinerl.contracts.engine.EngineKind")
    return kind
