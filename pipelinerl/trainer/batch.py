"""From a list of scored samples to packed micro-batches: validation, group advantages, packing.

Every rank of the trainer receives the whole step's batch: advantages are computed over all of it (they need
whole groups), the loss denominators count all of it, and each rank then packs its own share
(`samples[rank::world_size]`) into micro-batches of at most `micro_batch_tokens` tokens.

One packed row holds several `prompt + output` sequences back to back (positions restart per sequence); the
per-token fields are aligned with `input_ids`:
- `loss_mask`: True on output tokens (the ones the policy is trained on), False on prompt tokens;
- `behav_logprobs`: the engine's log-prob of each output token (0 on prompt tokens);
- `advantages`: the sample's advantage on each of its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from pipelinerl.rl.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from pipelinerl.rl.packing import PackedBatch, build_packed_batch, pack_sequences
from pipelinerl.samples import Sample

ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


@dataclass
class MicroBatch:
    """One packed row. `weight` is 0 for a padding micro-batch that only keeps data-parallel ranks in step
    (every rank must run the same number of forward/backward passes under ZeRO-3 or FSDP)."""

    packed: PackedBatch
    sample_indices: list[int]
    weight: float = 1.0

    @property
    def num_tokens(self) -> int:
        return int(self.packed.input_ids.shape[1])


@dataclass
class StepBatch:
    """What one optimizer step trains on. Counts cover the whole batch (all ranks), for loss denominators."""

    samples: list[Sample]
    advantages: Tensor  # [N], one per sample
    micro_batches: list[MicroBatch]  # this rank's share
    num_samples: int
    num_output_tokens: int


def _where(i: int, s: Any) -> str:
    gid = s.get("group_id") if isinstance(s, Mapping) else getattr(s, "group_id", None)
    return f"sample {i} (group_id {gid!r})"


def to_samples(batch: Sequence[Sample | Mapping[str, Any]]) -> list[Sample]:
    """Accept `Sample`s or plain mappings (the trainer contract speaks of mappings); name the bad one."""
    out = []
    for i, s in enumerate(batch):
        if isinstance(s, Sample):
            out.append(s)
            continue
        try:
            out.append(Sample.model_validate(s))
        except ValidationError as e:
            raise ValueError(f"{_where(i, s)}: not a valid sample: {e}") from None
    return out


def validate_samples(samples: Sequence[Sample], micro_batch_tokens: int) -> None:
    """Refuse a batch the trainer cannot train on correctly, naming the first bad sample.

    `Sample` checks its lengths when it is built, but `model_construct` or later mutation can bypass that;
    a silently misaligned sample would train on the wrong tokens, so lengths are checked again here.
    """
    if not samples:
        raise ValueError("empty batch: an optimizer step needs at least one sample")
    for i, s in enumerate(samples):
        where = _where(i, s)
        n = len(s.output_token_ids)
        if len(s.behav_logprobs) != n or len(s.versions) != n:
            raise ValueError(f"{where}: {n} output tokens but {len(s.behav_logprobs)} log-probs and "
                             f"{len(s.versions)} versions")
        if n == 0:
            raise ValueError(f"{where}: empty output sequence (nothing to train on)")
        if not s.prompt_token_ids:
            raise ValueError(f"{where}: empty prompt")
        if not math.isfinite(s.reward):
            raise ValueError(f"{where}: reward is {s.reward}")
        bad = next((j for j, lp in enumerate(s.behav_logprobs) if not math.isfinite(lp)), None)
        if bad is not None:
            raise ValueError(f"{where}: behaviour log-prob of output token {bad} is {s.behav_logprobs[bad]}")
        length = len(s.prompt_token_ids) + n
        if length > micro_batch_tokens:
            raise ValueError(f"{where}: {length} tokens (prompt + output) exceed micro_batch_tokens "
                             f"{micro_batch_tokens}")


def group_advantages(samples: Sequence[Sample], estimator: str) -> Tensor:
    """One advantage per sample from its reward and its group's rewards (groups keyed by `group_id`)."""
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ADVANTAGES)}")
    labels: dict[str, int] = {}
    group_ids = torch.tensor([labels.setdefault(s.group_id, len(labels)) for s in samples], dtype=torch.long)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return ADVANTAGES[estimator](rewards, group_ids)


def pack_samples(samples: Sequence[Sample], advantages: Tensor, indices: Sequence[int], token_budget: int,
                 device: torch.device | str | None = None) -> list[MicroBatch]:
    """Pack the samples at `indices` into micro-batches of at most `token_budget` tokens (no padding)."""
    lengths = [len(samples[i].prompt_token_ids) + len(samples[i].output_token_ids) for i in indices]
    micro_batches = []
    for bin_ in pack_sequences(lengths, token_budget):
        chosen = [indices[b] for b in bin_]
        micro_batches.append(MicroBatch(_pack(samples, advantages, chosen, device), chosen))
    return micro_batches


def _pack(samples: Sequence[Sample], advantages: Tensor, chosen: Sequence[int],
          device: torch.device | str | None) -> PackedBatch:
    sequences, mask, behav, adv = [], [], [], []
    for i in chosen:
        s = samples[i]
        p, o = len(s.prompt_token_ids), len(s.output_token_ids)
        sequences.append(list(s.prompt_token_ids) + list(s.output_token_ids))
        mask.append(torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(o, dtype=torch.bool)]))
        behav.append([0.0] * p + list(s.behav_logprobs))
        adv.append(torch.full((p + o,), float(advantages[i])))
    return build_packed_batch(sequences, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv},
                              device=device)


def pad_micro_batches(micro_batches: list[MicroBatch], target: int, filler: MicroBatch) -> list[MicroBatch]:
    """Append zero-weight copies of `filler` until there are `target` micro-batches."""
    pads = [MicroBatch(filler.packed, [], weight=0.0) for _ in range(target - len(micro_batches))]
    return micro_batches + pads


def build_step(batch: Sequence[Sample | Mapping[str, Any]], advantage: str, micro_batch_tokens: int,
               rank: int = 0, world_size: int = 1, device: torch.device | str | None = None) -> StepBatch:
    """Validate the batch, compute advantages over all of it and pack this rank's share."""
    samples = to_samples(batch)
    validate_samples(samples, micro_batch_tokens)
    advantages = group_advantages(samples, advantage)
    mine = list(range(rank, len(samples), world_size))
    micro_batches = pack_samples(samples, advantages, mine, micro_batch_tokens, device) if mine else []
    return StepBatch(samples=samples, advantages=advantages, micro_batches=micro_batches,
                     num_samples=len(samples),
                     num_output_tokens=sum(len(s.output_token_ids) for s in samples))


def filler_micro_batch(step: StepBatch, micro_batch_tokens: int, device: torch.device | str | None) -> MicroBatch:
    """A micro-batch of sample 0, for ranks that need padding passes (its loss is multiplied by 0)."""
    return pack_samples(step.samples, step.advantages, [0], micro_batch_tokens, device)[0]
