"""Token sampling for a batch of sequences with per-sequence parameters.

The reported log-probability is log softmax(logits / temperature) at the chosen token (temperature 1 for
greedy rows), before top-k/top-p truncation: what the inference contract promises the trainer.

The decode loop samples the same batch step after step, so what can be known before the logits arrive (all
greedy? any truncation? which rows are seeded?) is worked out once per batch, in `SamplingBatch`, and a step
runs only the ops its batch needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a batch, with the facts about them that decide which ops a step runs."""

    temperature: torch.Tensor  # [B], 0 = greedy
    top_k: torch.Tensor  # [B], 0 = off
    top_p: torch.Tensor  # [B], 1 = off
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool
    truncate: bool  # some row has top-k or top-p on
    divisor: torch.Tensor  # [B, 1]: the temperature, 1 on greedy rows
    seeded: list[int]  # rows with their own generator

    @classmethod
    def of(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
           generators: Sequence[torch.Generator | None], device: torch.device | str = "cpu") -> SamplingBatch:
        temp = torch.tensor(temperature, dtype=torch.float32, device=device)
        k = torch.tensor(top_k, dtype=torch.long, device=device)
        p = torch.tensor(top_p, dtype=torch.float32, device=device)
        greedy = temp == 0  # decided on the float32 values the step uses, not on the Python floats
        return cls(temperature=temp, top_k=k, top_p=p, generators=list(generators),
                   all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
                   truncate=bool((k > 0).any()) or bool((p < 1).any()),
                   divisor=torch.where(greedy, 1.0, temp)[:, None],
                   seeded=[i for i, g in enumerate(generators) if g is not None])


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32. Returns (token ids [B], log-probs [B])."""
    if batch.all_greedy:  # the common evaluation case: no scaling, no noise
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / batch.divisor, dim=-1)
    filtered = _truncate(logp, batch.top_k, batch.top_p) if batch.truncate else logp
    # Gumbel-max: argmax(log p + Gumbel noise) is a sample from p.
    tokens = _gumbel_(torch.empty_like(filtered), batch).add_(filtered).argmax(-1)
    if batch.any_greedy:
        tokens = torch.where(batch.temperature == 0, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_batch` with the parameters as tensors: per-row temperature (0 = greedy), top_k (0 = off),
    top_p (1 = off)."""
    batch = SamplingBatch.of(temperature.tolist(), top_k.tolist(), top_p.tolist(), generators, logits.device)
    return sample_batch(logits, batch)


def _truncate(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    vocab = logp.shape[-1]
    rank = torch.arange(vocab, device=logp.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)[:, None]
    drop = rank >= k
    cum = sorted_logp.exp().cumsum(-1)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    drop |= (cum - sorted_logp.exp()) >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 would drop all)
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logp).scatter_(1, order, sorted_logp)


def _gumbel_(u: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Fill u [B, V] with Gumbel noise, the seeded rows from their own generators; in place."""
    if len(batch.seeded) < len(batch.generators):
        u.uniform_()
    for i in batch.seeded:
        u[i].uniform_(generator=batch.generators[i])
    return u.clamp_(1e-20, 1.0 - 1e-7).log_().neg_().log_().neg_()
