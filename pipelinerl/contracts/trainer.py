"""The trainer contract: what the pipeline needs from a trainer, whatever shards its parameters.

A trainer built on plain torch, accelerate + DeepSpeed ZeRO-3 or FSDP implements this Protocol; the pipeline
(launcher, weight push, checkpoints) only talks to it through these methods. See contracts/README.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pipelinerl.weight_sync import WeightUpdateGroup


@dataclass
class BroadcastStats:
    version: int
    bytes: int
    seconds: float


@runtime_checkable
class TrainerBackend(Protocol):
    @property
    def version(self) -> int:
        """Weight version of the current parameters: 0 for the initial model, +1 per optimizer step."""
        ...

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every parameter, gathered in full even when sharded (ZeRO-3, FSDP), under the name the
        inference model uses (`model.layers.0.self_attn.q_proj.weight`), in a fixed order. On ranks other
        than 0 of a sharded trainer it must still be iterated (gathering is collective) but may yield
        nothing useful."""
        ...

    def broadcast_weights(self, group: WeightUpdateGroup, engine_urls: Sequence[str]) -> BroadcastStats:
        """Ask every engine to receive version `self.version` (HTTP, concurrently) and broadcast the full
        parameters from rank 0 of `group`; return once every engine has switched to them."""
        ...

    def optimizer_step(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Take one optimizer step on a batch of scored samples; advance `version`; return logged stats."""
        ...
