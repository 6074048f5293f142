"""Sequence packing: put several variable-length sequences in one row so no compute is spent on padding.

A packed row concatenates the sequences; ``position_ids`` restart at 0 for each one (so rotary embeddings see
the same positions as unpacked), and attention must be block-diagonal causal so that no token attends to
another sequence.

How this reaches a transformers causal LM (checked against transformers 5.19 ``masking_utils``):

* A 4-D ``attention_mask`` ``[B, 1, Q, K]`` is passed through untouched by ``create_causal_mask`` for every
  attention implementation. With ``sdpa`` it goes to ``torch.nn.functional.scaled_dot_product_attention``,
  which accepts a bool mask (True = attend) or an additive float mask. With ``eager`` it is *added* to the
  scores, so it must be an additive float mask (0 / large negative): a bool mask is silently wrong there.
* Without a mask, transformers detects packing from ``position_ids`` that do not increase by 1
  (``find_packed_sequence_indices`` for sdpa/eager/flex, ``_is_packed_sequence`` -> varlen kernels for
  flash-attention), but only when ``attention_mask is None`` and there is no KV cache. ``use_cache``
  defaults to True in the config, even in train mode, and then a ``DynamicCache`` is created before the mask
  is built, which silently disables the detection: the forward must pass ``use_cache=False``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from pipelinerl.rl.losses import logprobs_from_logits


def pack_sequences(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices into micro-batches of <= ``token_budget`` tokens.

    Sequences are visited longest first (ties by index) and each goes into the first micro-batch with room,
    else a new one. FFD uses at most 11/9 OPT + 6/9 bins. Returns lists of indices into ``lengths``; within
    a micro-batch, indices are in placement order (non-increasing length). Raises ValueError naming the
    sample if a length is not positive or exceeds the budget.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} is empty (length {n})")
        if n > token_budget:
            raise ValueError(f"sample {i} has length {n}, longer than the token budget {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(token_budget - n)
    return bins


@dataclass
class PackedBatch:
    """Several sequences concatenated into one row of ``T`` tokens.

    * ``input_ids``, ``position_ids``: ``[1, T]`` long; positions restart at 0 for each sequence.
    * ``seq_ids``: ``[T]`` long, the index (0..N-1, in input order) of the sequence each token belongs to.
    * ``cu_seqlens``: ``[N + 1]`` int32 cumulative lengths ``[0, l0, l0 + l1, ...]`` (flash-attn varlen
      format).
    * ``label_mask``: ``[T]`` bool, False on the first token of each sequence (nothing in the sequence
      predicts it), True elsewhere; :func:`packed_logprobs` is 0 where it is False.
    * ``fields``: extra per-token values (e.g. advantages, behaviour log-probs, loss mask), each ``[T]``.
    """

    input_ids: Tensor
    position_ids: Tensor
    seq_ids: Tensor
    cu_seqlens: Tensor
    label_mask: Tensor
    lengths: list[int]
    fields: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)


def build_packed_batch(
    sequences: Sequence[Sequence[int]],
    token_fields: Mapping[str, Sequence[Sequence[float] | Tensor]] | None = None,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Concatenate token-id sequences into a :class:`PackedBatch`.

    ``token_fields`` maps a name to per-token values for each sequence (lists or 1-D tensors, same lengths as
    ``sequences``); each is concatenated into a ``[T]`` tensor in ``PackedBatch.fields`` (bool if all values
    are bool, else float32), aligned with ``input_ids``. Raises ValueError naming the sample for an empty
    sequence or a field whose length differs from its sequence.
    """
    if not sequences:
        raise ValueError("no sequences to pack")
    lengths = [len(s) for s in sequences]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"sample {i} is empty")
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    lengths_t = torch.tensor(lengths, device=device)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lengths_t, 0)
    positions = torch.arange(ids.numel(), device=device) - cu[:-1].long()[seq_ids]
    fields = {}
    for name, values in (token_fields or {}).items():
        if len(values) != len(sequences):
            raise ValueError(f"field {name!r} has {len(values)} sequences, expected {len(sequences)}")
        for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
            if len(v) != n:
                raise ValueError(f"field {name!r} of sample {i} has {len(v)} values, sequence has {n} tokens")
        parts = [torch.as_tensor(v, device=device) for v in values]
        dtype = torch.bool if all(part.dtype == torch.bool for part in parts) else torch.float32
        fields[name] = torch.cat([part.to(dtype) for part in parts])
    return PackedBatch(
        input_ids=ids[None],
        position_ids=positions[None],
        seq_ids=seq_ids,
        cu_seqlens=cu,
        label_mask=positions > 0,
        lengths=lengths,
        fields=fields,
    )


def packed_causal_mask(seq_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` (bool, True = may attend) from per-token sequence ids.

    ``mask[0, 0, q, k] = seq_ids[q] == seq_ids[k] and k <= q``. Pass it as ``attention_mask`` with
    ``attn_implementation="sdpa"``; for ``"eager"`` convert it with :func:`to_additive_mask` first. It is a
    ``T x T`` tensor: for long rows prefer flash-attention with ``position_ids`` only.
    """
    seq_ids = seq_ids.reshape(-1)
    t = seq_ids.numel()
    causal = torch.ones(t, t, dtype=torch.bool, device=seq_ids.device).tril()
    return (causal & (seq_ids[:, None] == seq_ids[None, :]))[None, None]


def to_additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = attend) -> additive float mask (0 where attend, dtype's min elsewhere) for eager."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    attention: Literal["auto", "mask", "position_ids"] = "auto",
) -> Tensor:
    """Log-prob of every token of a packed row given the earlier tokens of its own sequence, shape ``[T]``.

    ``out[t] = log p(input_ids[t] | input_ids[start(t):t])``, aligned with ``input_ids`` (so with per-token
    advantages and behaviour log-probs); ``out`` is 0 at the first token of each sequence
    (``batch.label_mask`` False). Gradients flow to the model.

    ``attention`` picks how sequences are kept apart: ``"mask"`` passes :func:`packed_causal_mask` (bool for
    sdpa, additive float for eager), ``"position_ids"`` passes no mask and relies on transformers' detection
    of restarting positions (works for sdpa, eager and flash-attention). ``"auto"`` uses the mask for
    sdpa/eager and position ids otherwise. ``use_cache=False`` is always passed (a cache disables detection).
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention == "auto":
        attention = "mask" if impl in ("sdpa", "eager") else "position_ids"
    kwargs: dict = {"position_ids": batch.position_ids, "use_cache": False}
    if attention == "mask":
        mask = packed_causal_mask(batch.seq_ids)
        if impl == "eager":
            mask = to_additive_mask(mask, next(model.parameters()).dtype)
        elif impl != "sdpa":
            raise ValueError(f"a 4-D mask is only supported here for sdpa or eager attention, not {impl!r}")
        kwargs["attention_mask"] = mask
    elif attention != "position_ids":
        raise ValueError(f"unknown attention mode {attention!r}")
    logits = model(input_ids=batch.input_ids, **kwargs).logits[0]
    next_lp = logprobs_from_logits(logits[:-1], batch.input_ids[0, 1:], temperature)
    out = torch.cat([next_lp.new_zeros(1), next_lp])
    return torch.where(batch.label_mask, out, torch.zeros_like(out))
