"""The trainer contract: what the trainer role (`pipelinerl.train.train`) calls on a trainer, whatever shards its
parameters, and nothing more.

A trainer built on plain torch, accelerate + DeepSpeed ZeRO-3 or FSDP (`pipelinerl.trainer.Trainer`) implements
this Protocol; `train()` talks to the trainer only through it: pass any object that does to
`train(cfg, engines, trainer=...)`. tests/test_trainer_contract.py runs the whole role on a small fake written
against this Protocol alone. See contracts/README.md.

The weight-update group is the trainer's own object: `train()` only hands back what `connect_engines` and
`ensure_engines` returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class BroadcastStats:
    version: int
    bytes: int
    seconds: float


@runtime_checkable
class TrainerBackend(Protocol):
    # --- who this process is -------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Weight version of the current parameters: 0 for the initial model, +1 per optimizer step."""
        ...

    @property
    def is_main_process(self) -> bool:
        """The process that writes metrics, talks to the engines and evaluates (rank 0)."""
        ...

    @property
    def num_processes(self) -> int:
        """Trainer processes taking a share of each batch (1 unless sharded or data parallel)."""
        ...

    def any_process(self, *flags: bool) -> list[bool]:
        """For each flag, whether it holds on any trainer process (collective when there are several)."""
        ...

    def barrier(self, after: str) -> None:
        """Wait until every trainer process got here; `after` says what they were doing, for the error."""
        ...

    # --- training ------------------------------------------------------------------------------------------
    def optimizer_step(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Take one optimizer step on a batch of scored samples; advance `version` (unless every update was
        skipped for a non-finite loss or gradient: then the stats say `skipped` = 1); return logged stats."""
        ...

    def note_eval_score(self, score: float) -> None:
        """A held-out score at the current version (for a reference reset on a stagnating validation)."""
        ...

    # --- the engines ---------------------------------------------------------------------------------------
    def connect_engines(self, engine_urls: Sequence[str], ranks_per_engine: int = 1) -> Any:
        """Form the weight-update group with the engines; returns it (None: no group needed)."""
        ...

    def ensure_engines(self, group: Any, engine_urls: Sequence[str], ranks_per_engine: int, wait_s: float,
                       should_stop: Callable[[], bool], force: bool = False) -> tuple[Any, list[str]]:
        """Re-form the group when an engine was restarted (or `force`); returns it and the engines that rejoined.
        Raises pipelinerl.trainer.publisher.EngineWaitInterrupted when `should_stop` says so while waiting."""
        ...

    def broadcast_weights(self, group: Any, engine_urls: Sequence[str]) -> BroadcastStats:
        """Ask every engine to receive version `self.version` (HTTP, concurrently) and broadcast the full
        parameters from rank 0 of `group`; return once every engine has switched to them."""
        ...

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every parameter, gathered in full even when sharded (ZeRO-3, FSDP), under the name the
        inference model uses (`model.layers.0.self_attn.q_proj.weight`), in a fixed order. On ranks other
        than 0 of a sharded trainer it must still be iterated (gathering is collective) but may yield
        nothing useful."""
        ...

    # --- state on disk -------------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: Path, data_position: dict[str, Any]) -> Path:
        """Save all that resuming needs into `ckpt_dir` atomically (every process calls it)."""
        ...

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore from `ckpt_dir`; returns the `data_position` saved with it."""
        ...

    def export(self, out_dir: Path) -> Path:
        """Write the current model in Hugging Face format, loadable by any engine."""
        ...

    def close(self) -> None:
        """Release the engine connections and the processes' group; called once, last, on every exit path."""
        ...
