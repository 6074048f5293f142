"""From a list of scored samples to packed micro-batches: validation, minibatches, packing, advantages.

Every rank of the trainer receives the whole step's batch: advantages are computed over all of it (they need
whole groups), the loss denominators count all of it, and each rank then packs its own share of each minibatch
(`minibatch[rank::world_size]`) into micro-batches of at most `micro_batch_tokens` tokens. A step has
`trainer.ppo_minibatches` minibatches (consecutive slices of the batch), one optimizer update each.

One packed row holds several `prompt + output` sequences back to back (positions restart per sequence); the
per-token fields are aligned with `input_ids`:
- `loss_mask`: True on output tokens the policy is trained on; False on prompt tokens, on tool output tokens of a
  multi-turn sample (`Sample.output_mask`), and on the whole output of a truncated sample under overlong filtering;
- `behav_logprobs`: the engine's log-prob of each output token (0 on prompt tokens);
- `advantages`: the sample's advantage on each of its tokens (or a per-token one: GAE), set by the trainer once
  the no-grad passes (reference, critic) have run: `set_sample_advantages`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from torch import Tensor

from pipelinerl.rl.advantages import whiten
from pipelinerl.rl.packing import PackedBatch, build_packed_batch, pack_sequences
from pipelinerl.rl.registry import AdvantageInputs, advantage, settings_for
from pipelinerl.samples import Sample

if TYPE_CHECKING:
    from pipelinerl.config import TrainerConfig

TRUNCATED = "length"  # finish_reason of an output cut off by the length limit


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
class Minibatch:
    """One optimizer update's share of the step: this rank's micro-batches; counts over all ranks (denominators)."""

    micro_batches: list[MicroBatch]
    num_samples: int
    num_tokens: int  # tokens trained on (loss_mask) in the whole minibatch


@dataclass
class StepBatch:
    """What one optimizer step trains on. Per-sample tensors and counts cover the whole batch (all ranks)."""

    samples: list[Sample]
    group_ids: Tensor  # [N] long, dense group labels
    trained_tokens: Tensor  # [N] float, tokens of each sample in the loss (0 for one dropped by overlong filtering)
    minibatches: list[Minibatch]
    advantages: Tensor | None = None  # [N], once computed (per-token estimators: each sample's token mean)
    filtered: int = 0  # samples left out of the loss by overlong filtering
    left_out: int = 0  # samples left out of the forward and backward passes (no gradient to give; `build_step`)
    left_out_tokens: int = 0  # their trained tokens
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_output_tokens(self) -> int:
        """Tokens trained on in the whole step."""
        return int(self.trained_tokens.sum())

    @property
    def rewards(self) -> Tensor:
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """This rank's micro-batches of every minibatch, in order."""
        return [mb for m in self.minibatches for mb in m.micro_batches]


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
        if s.output_mask and len(s.output_mask) != n:
            raise ValueError(f"{where}: {n} output tokens but {len(s.output_mask)} output_mask values")
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


def dense_group_ids(samples: Sequence[Sample]) -> Tensor:
    labels: dict[str, int] = {}
    return torch.tensor([labels.setdefault(s.group_id, len(labels)) for s in samples], dtype=torch.long)


def sample_advantages(step: StepBatch, cfg: TrainerConfig, rewards: Tensor | None = None, whitened: bool = True
                      ) -> Tensor:
    """One advantage per sample from the registered estimator `trainer.advantage` (rewards: the samples' own,
    unless given, e.g. less a KL penalty), normalised over the batch where the estimator is `whitened` (unless
    `whitened` is False: the trainer then whitens per-token values itself)."""
    spec = advantage(cfg.advantage)
    if spec.token_level:
        raise ValueError(f"trainer.advantage {cfg.advantage!r} is computed per token (with the critic), not per sample")
    inputs = AdvantageInputs(rewards=step.rewards if rewards is None else rewards, group_ids=step.group_ids,
                             lengths=step.trained_tokens)
    adv = spec.fn(inputs, settings_for(spec, cfg))
    if adv.shape != (step.num_samples,):
        raise ValueError(f"advantage estimator {cfg.advantage!r} returned shape {tuple(adv.shape)}, expected "
                         f"({step.num_samples},): one advantage per sample")
    if spec.whitened and whitened:
        adv = whiten(adv, step.trained_tokens if cfg.whiten_over == "tokens" else None)
    return adv


def group_advantages(samples: Sequence[Sample], estimator: str, cfg: TrainerConfig | None = None) -> Tensor:
    """One advantage per sample from its reward and its group's rewards (groups keyed by `group_id`)."""
    from pipelinerl.config import TrainerConfig

    cfg = dataclasses.replace(cfg or TrainerConfig(), advantage=estimator)
    step = StepBatch(samples=list(samples), group_ids=dense_group_ids(samples),
                     trained_tokens=torch.tensor([float(s.trained_tokens) for s in samples]), minibatches=[])
    return sample_advantages(step, cfg)


def set_sample_advantages(micro_batches: Sequence[MicroBatch], advantages: Tensor) -> None:
    """Put each sample's advantage on every token of it (the `advantages` field)."""
    for mb in micro_batches:
        p = mb.packed
        per_seq = advantages.to(p.input_ids.device, torch.float32)[torch.tensor(mb.sample_indices, dtype=torch.long)]
        p.fields["advantages"] = per_seq[p.seq_ids.to(per_seq.device)]


# Whether a micro-batch's sequences (their lengths, prompt and completion each) should share their prompts, given
# the tokens they would then take (the trainer's `rl.packing.shared_prompts_are_cheaper` for its model)
SharePrompts = Callable[[Sequence[int], int], bool]


def pack_samples(samples: Sequence[Sample], indices: Sequence[int], token_budget: int,
                 device: torch.device | str | None = None, overlong_filtering: bool = False,
                 share_prompts: SharePrompts | None = None) -> list[MicroBatch]:
    """Pack the samples at `indices` into micro-batches of at most `token_budget` tokens (no padding). With
    `share_prompts`, the samples of a micro-batch that have the same prompt (a group) are put side by side, and
    share it where `share_prompts` says so (`rl.packing`: the same log-probs and gradients, fewer tokens)."""
    lengths = [len(samples[i].prompt_token_ids) + len(samples[i].output_token_ids) for i in indices]
    micro_batches = []
    for bin_ in pack_sequences(lengths, token_budget):
        chosen = [indices[b] for b in bin_]
        prompt_lengths = None
        if share_prompts is not None:
            chosen, prompt_lengths = _prompts_shared(samples, chosen, [lengths[b] for b in bin_], share_prompts)
        micro_batches.append(MicroBatch(_pack(samples, chosen, device, overlong_filtering, prompt_lengths), chosen))
    return micro_batches


def _prompts_shared(samples: Sequence[Sample], chosen: Sequence[int], lengths: Sequence[int],
                    share_prompts: SharePrompts) -> tuple[list[int], list[int] | None]:
    """`chosen` (their `lengths`, prompt and completion each) with the samples of each prompt side by side (in
    the order prompts first appear), and their prompt lengths where sharing the prompts pays (else `chosen` as it
    was, and None)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in chosen:
        by_prompt.setdefault(tuple(samples[i].prompt_token_ids), []).append(i)
    if len(by_prompt) == len(chosen):
        return list(chosen), None  # no two samples share a prompt
    # a prompt is packed once per group, a completion after it (an empty one keeps its own prompt)
    shared_tokens = sum(lengths) - sum(len(p) * (sum(bool(samples[i].output_token_ids) for i in group) - 1)
                                       for p, group in by_prompt.items()
                                       if any(samples[i].output_token_ids for i in group))
    if not share_prompts(lengths, shared_tokens):
        return list(chosen), None
    ordered = [i for group in by_prompt.values() for i in group]
    return ordered, [len(samples[i].prompt_token_ids) for i in ordered]


def _pack(samples: Sequence[Sample], chosen: Sequence[int], device: torch.device | str | None,
          overlong_filtering: bool, prompt_lengths: Sequence[int] | None = None) -> PackedBatch:
    sequences, mask, behav, adv = [], [], [], []
    for i in chosen:
        s = samples[i]
        p, o = len(s.prompt_token_ids), len(s.output_token_ids)
        trained = not (overlong_filtering and s.finish_reason == TRUNCATED)
        sequences.append(list(s.prompt_token_ids) + list(s.output_token_ids))
        output = torch.full((o,), trained, dtype=torch.bool)
        if s.output_mask:  # multi-turn: tool output tokens are context, not the policy's actions
            output &= torch.tensor(s.output_mask, dtype=torch.bool)
        mask.append(torch.cat([torch.zeros(p, dtype=torch.bool), output]))
        behav.append([0.0] * p + list(s.behav_logprobs))
        adv.append(torch.zeros(p + o))
    return build_packed_batch(sequences, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv},
                              device=device, prompt_lengths=prompt_lengths)


def pad_micro_batches(micro_batches: list[MicroBatch], target: int, filler: MicroBatch) -> list[MicroBatch]:
    """Append zero-weight copies of `filler` until there are `target` micro-batches."""
    pads = [MicroBatch(filler.packed, filler.sample_indices, weight=0.0) for _ in range(target - len(micro_batches))]
    return micro_batches + pads


def minibatch_slices(num_samples: int, minibatches: int) -> list[range]:
    """`minibatches` consecutive, near-equal slices of the batch (no empty one: at most one per sample)."""
    k = max(1, min(minibatches, num_samples))
    bounds = [round(j * num_samples / k) for j in range(k + 1)]
    return [range(bounds[j], bounds[j + 1]) for j in range(k)]


def build_step(batch: Sequence[Sample | Mapping[str, Any]], micro_batch_tokens: int, rank: int = 0,
               world_size: int = 1, device: torch.device | str | None = None, minibatches: int = 1,
               overlong_filtering: bool = False, leave_out: Callable[[StepBatch], Tensor] | None = None,
               share_prompts: SharePrompts | None = None) -> StepBatch:
    """Validate the batch, split it into minibatches and pack this rank's share of each. Advantages come later
    (`sample_advantages`, `set_sample_advantages`): some estimators need the no-grad passes first.

    `leave_out(step)` ([N] bool, the same on every rank) names samples that add nothing to the gradient: they are
    not packed, but the minibatches' denominators (`num_samples`, `num_tokens`) still count them, so the loss of
    what is packed is the loss of the whole batch. A minibatch left with nothing to pack gets one zero-weight
    micro-batch on every rank, so that its optimizer update still runs (on zero gradients, as it would have)."""
    samples = to_samples(batch)
    validate_samples(samples, micro_batch_tokens)
    dropped = [overlong_filtering and s.finish_reason == TRUNCATED for s in samples]
    trained = torch.tensor([0.0 if d else float(s.trained_tokens) for s, d in zip(samples, dropped)])
    step = StepBatch(samples=samples, group_ids=dense_group_ids(samples), trained_tokens=trained, minibatches=[],
                     filtered=sum(dropped))
    left_out = leave_out(step).tolist() if leave_out is not None else [False] * len(samples)
    for part in minibatch_slices(len(samples), minibatches):
        # ranks share the samples that are packed, so that a left-out group does not leave one rank idle
        kept = [i for i in part if not left_out[i]]
        mine = kept[rank::world_size]
        mbs = pack_samples(samples, mine, micro_batch_tokens, device, overlong_filtering, share_prompts) \
            if mine else []
        if not kept:
            mbs = pad_micro_batches([], 1, filler_micro_batch(step, micro_batch_tokens, device))
        step.minibatches.append(Minibatch(mbs, num_samples=len(part),
                                          num_tokens=int(trained[part.start:part.stop].sum())))
    step.left_out = sum(left_out)
    step.left_out_tokens = int(sum(t for t, out in zip(trained.tolist(), left_out) if out))
    return step


def filler_micro_batch(step: StepBatch, micro_batch_tokens: int, device: torch.device | str | None) -> MicroBatch:
    """A micro-batch of sample 0, for ranks that need padding passes (its loss is multiplied by 0)."""
    return pack_samples(step.samples, [0], micro_batch_tokens, device)[0]
