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

    Sequences are right-padded within a batch; the loss mask covers the target (and its EOS) so the model
    learns to answer, not to predict prompts. A batch is drawn from one of `length_buckets(...)`, equal shares of
    the examples by length, chosen uniformly: every example is as likely as without buckets, but a batch is as wide
    as its own bucket's longest (a mix of 12-character sums and 150-character instructions would otherwise pad
    every sum to 150). It trains where the model's parameters are (a GPU, if the caller put it there).
    """
    device = next(model.parameters()).device
    rng = random.Random(seed)
    torch.manual_seed(seed)
    encoded = [(tokenizer.encode(p), tokenizer.encode(t) + [tokenizer.eos_token_id]) for p, t in examples]
    buckets = length_buckets([len(p) + len(t) for p, t in encoded], batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="supervised warm-up", unit="step", disable=not progress, mininterval=1.0)
    for step in bar:
        bucket = buckets[rng.randrange(len(buckets))] if len(buckets) > 1 else None  # one: the draws as before
        batch = [encoded[rng.randrange(len(encoded))] if bucket is None else encoded[bucket[rng.randrange(len(bucket))]]
                 for _ in range(batch_size)]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (p, t) in enumerate(batch):
            ids[i, : len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p): len(p) + len(t)] = torch.tensor(t)
        # shift inside the model: labels[i, j] is predicted from ids[i, :j]
        loss = model(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def length_buckets(lengths: list[int], batch_size: int, most: int = 8) -> list[list[int]]:
    """The indices of `lengths` sorted by length and cut into up to `most` equal shares (no share under
    `batch_size` examples; one share when all are about as long, within 25%: buckets would save nothing)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if not order or lengths[order[-1]] <= 1.25 * lengths[order[0]]:
        return [order]
    count = max(1, min(most, len(order) // max(1, batch_size)))
    return [order[k * len(order) // count:(k + 1) * len(order) // count] for k in range(count)]


def warm_up_saved_model(path: str, examples: list[tuple[str, str]], steps: int, batch_size: int, lr: float,
                        seed: int, device: str = "cpu") -> None:
    """Load the float32 model and tokenizer saved in `path`, give it `supervised_warmup` on `device`, and save it
    back (from the CPU). The launcher runs this in a child process on a GPU node (see `prepare_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    supervised_warmup(model.to(device), tokenizer, examples, steps, batch_size, lr, seed)
    model.to("cpu").save_pretrained(path)
