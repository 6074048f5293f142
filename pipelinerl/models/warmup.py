"""A short supervised warm-up that gives a tiny model a low but non-zero success rate on a task, so RL has a
signal to amplify. Deterministic under a seed; the launcher caches the result in the run directory."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from tqdm import tqdm


def supervised_warmup(model: torch.nn.Module, tokenizer, examples: list[tuple[str, str]], steps: int,
                      batch_size: int = 64, lr: float = 3e-3, seed: int = 0,
                      progress: bool = True, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train on (prompt, target) pairs with cross-entropy on the target tokens only; returns the losses.

    Sequences are right-padded within a batch (within runs of about one length: `by_width`); the loss mask covers
    the target (and its EOS) so the model learns to answer, not to predict prompts. It trains where the model's
    parameters are (a GPU, if the caller put it there).
    """
    device = next(model.parameters()).device
    rng = random.Random(seed)
    torch.manual_seed(seed)
    encoded = [(tokenizer.encode(p), tokenizer.encode(t) + [tokenizer.eos_token_id]) for p, t in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="supervised warm-up", unit="step", disable=not progress, mininterval=1.0)
    for step in bar:
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        targets = sum(len(t) for _, t in batch)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for chunk in by_width(batch):
            # the batch's mean over its target tokens, summed chunk by chunk: the gradient of one padded batch
            part = _chunk_loss(model, tokenizer, chunk, device) * (sum(len(t) for _, t in chunk) / targets)
            part.backward()
            loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def _chunk_loss(model: torch.nn.Module, tokenizer, chunk: list[tuple[list[int], list[int]]],
                device: torch.device) -> torch.Tensor:
    """Mean cross-entropy over the chunk's target tokens, its sequences right-padded to the longest."""
    width = max(len(p) + len(t) for p, t in chunk)
    ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
    labels = torch.full((len(chunk), width), -100)
    for i, (p, t) in enumerate(chunk):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p): len(p) + len(t)] = torch.tensor(t)
    # shift inside the model: labels[i, j] is predicted from ids[i, :j]
    return model(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss


def by_width(batch: list[tuple[list[int], list[int]]], chunks: int = 4) -> list[list[tuple[list[int], list[int]]]]:
    """The batch cut, by length, into up to `chunks` runs padded each to its own longest, where that saves a fifth
    of the padded tokens (a mix's 12-token sums would otherwise be padded to its 150-token instructions); else the
    batch whole. Same examples, same loss: only the padding goes."""
    lengths = [len(p) + len(t) for p, t in batch]
    ordered = sorted(range(len(batch)), key=lengths.__getitem__)
    runs = [ordered[k * len(batch) // chunks:(k + 1) * len(batch) // chunks] for k in range(chunks)]
    runs = [r for r in runs if r]
    padded = sum(len(r) * max(lengths[i] for i in r) for r in runs)
    if padded > 0.8 * len(batch) * max(lengths, default=0):
        return [batch]
    return [[batch[i] for i in r] for r in runs]


def warm_up_saved_model(path: str, examples: list[tuple[str, str]], steps: int, batch_size: int, lr: float,
                        seed: int, device: str = "cpu") -> None:
    """Load the float32 model and tokenizer saved in `path`, give it `supervised_warmup` on `device`, and save it
    back (from the CPU). The launcher runs this in a child process on a GPU node (see `prepare_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    supervised_warmup(model.to(device), tokenizer, examples, steps, batch_size, lr, seed)
    model.to("cpu").save_pretrained(path)
