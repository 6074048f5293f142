"""Token sampling for a batch of sequences with per-sequence parameters.

The reported log-probability is log softmax(logits / temperature) at the chosen token (temperature 1 for
greedy rows), before top-k/top-p truncation: what the inference contract promises the trainer.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32; per-row temperature (0 = greedy), top_k (0 = off), top_p (1 = off).
    Returns (token ids [B], log-probs [B])."""
    greedy = temperature == 0
    if bool(greedy.all()):  # the common evaluation case: no scaling, no noise
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)

    filtered = logp
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        filtered = _truncate(logp, top_k, top_p)
    noise = _gumbel(filtered.shape, generators, filtered.device)
    # Gumbel-max: argmax(log p + Gumbel noise) is a sample from p.
    tokens = torch.where(greedy, logits.argmax(-1), (filtered + noise).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _truncate(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    vocab = logp.shape[-1]
    rank = torch.arange(vocab, device=logp.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)[:, None]
    drop = rank >= k
    cum = sorted_logp.exp().cumsum(-1)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    drop |= (cum - sorted_logp.exp()) >= top_p[:, None]
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logp).scatter_(1, order, sorted_logp)


def _gumbel(shape: torch.Size, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    u = torch.empty(shape, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=generators[i])
    return -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
