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
* With ``flash_attention_2`` no mask is ever built (``flash_attention_mask`` returns None without padding): the
  varlen kernel takes ``cu_seq_lens_q/k`` and ``max_length_q/k`` (``FlashAttentionKwargs``), which the forward
  passes down to every attention layer. Given here from :class:`PackedBatch`, they spare transformers from
  re-deriving them from ``position_ids`` in each layer (two host syncs per layer). sdpa and eager always end up
  with a dense ``[T, T]`` mask, ours or the one transformers builds from the positions.
* Without flash-attention, a packed row's sequences can instead go through the model as right-padded rows
  ``[N, L]`` (the ``"padded"`` attention mode; :func:`padded_rows`), with no mask but the causal one: a real
  token never attends to the padding after it, and the padding's outputs are dropped. Attention then costs
  ``N * L^2`` instead of ``T^2`` for the dense mask, at the price of ``N * L - T`` padding tokens through every
  layer; ``"auto"`` takes whichever costs less (:func:`padded_is_cheaper`). On CPU, 32 sequences of 160 tokens
  under a 24M model: 8.7 s forward and backward as padded rows, 17.3 s as rows of 4096 tokens under the mask.

Sequences that begin with the same prompt (a GRPO group) can share it (``prompt_lengths`` of
:func:`build_packed_batch`): the prompt appears once, each completion after it, its positions going on from the
prompt's end, and the mask lets a completion attend to the prompt and to itself only. Every log-prob and gradient is
that of the unshared row (the prompt's activations get the sum of what each copy would have got); only the prompt's
repeats are no longer computed. It needs the mask (sdpa or eager): :func:`shared_prompts_are_cheaper` says when
it pays. A group of 8 answers of 4 tokens to a 9-token prompt is 41 tokens instead of 104.

The forward passes over these rows (a chunked LM head, log-probs and entropy) are the trainer's:
`pipelinerl/trainer/forward.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor


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
      predicts it), True elsewhere; `trainer.forward.packed_logprobs` is 0 where it is False.
    * ``fields``: extra per-token values (e.g. advantages, behaviour log-probs, loss mask), each ``[T]``.
    * With shared prompts (``build_packed_batch(prompt_lengths=...)``; all three None without): ``tree_ids``
      ``[T]`` long, the tokens of one prompt and the completions after it; ``shared`` ``[T]`` bool, True on a
      prompt that several sequences share (its tokens count as the first one's: ``seq_ids``, ``lengths``);
      ``prev_index`` ``[T]`` long, the token whose output predicts each token (the one before it, but the
      prompt's last token for a completion's first).
    """

    input_ids: Tensor
    position_ids: Tensor
    seq_ids: Tensor
    cu_seqlens: Tensor
    label_mask: Tensor
    lengths: list[int]
    fields: dict[str, Tensor] = field(default_factory=dict)
    tree_ids: Tensor | None = None
    shared: Tensor | None = None
    prev_index: Tensor | None = None

    @property
    def shares_prompts(self) -> bool:
        return self.tree_ids is not None

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
    prompt_lengths: Sequence[int] | None = None,
) -> PackedBatch:
    """Concatenate token-id sequences into a :class:`PackedBatch`.

    ``token_fields`` maps a name to per-token values for each sequence (lists or 1-D tensors, same lengths as
    ``sequences``); each is concatenated into a ``[T]`` tensor in ``PackedBatch.fields`` (bool if all values
    are bool, else float32), aligned with ``input_ids``. Raises ValueError naming the sample for an empty
    sequence or a field whose length differs from its sequence.

    ``prompt_lengths`` (one per sequence): a sequence whose prompt is that of the sequence before it (the same
    tokens) shares it: its prompt tokens are left out and its completion attends to the earlier one's (see the
    module docstring); the shared tokens keep the first sequence's field values, so they must be ones that do not
    depend on the sequence (prompt tokens are not trained on). A sequence with no token after its prompt keeps
    its own prompt.
    """
    if not sequences:
        raise ValueError("no sequences to pack")
    lengths = [len(s) for s in sequences]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"sample {i} is empty")
    if prompt_lengths is not None:
        return _build_shared_prompt_batch(sequences, token_fields or {}, device, prompt_lengths)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    cu = _cu_seqlens(lengths, device)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), cu.diff())
    positions = torch.arange(ids.numel(), device=device) - cu[:-1].long()[seq_ids]
    fields = _packed_fields(token_fields or {}, lengths, [0] * len(lengths), device)
    return PackedBatch(
        input_ids=ids[None],
        position_ids=positions[None],
        seq_ids=seq_ids,
        cu_seqlens=cu,
        label_mask=positions > 0,
        lengths=lengths,
        fields=fields,
    )


def _cu_seqlens(lengths: Sequence[int], device: torch.device | str | None) -> Tensor:
    """``[0, l0, l0 + l1, ...]``, int32 (flash-attn's varlen format)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    return cu


def _packed_fields(token_fields: Mapping[str, Sequence], lengths: Sequence[int], starts: Sequence[int],
                   device: torch.device | str | None) -> dict[str, Tensor]:
    """Each field's values of every sequence from its token ``starts[i]`` on, concatenated (bool if all values are
    bool, else float32); raises ValueError naming the field and sample whose values do not match its tokens."""
    fields = {}
    for name, values in token_fields.items():
        if len(values) != len(lengths):
            raise ValueError(f"field {name!r} has {len(values)} sequences, expected {len(lengths)}")
        for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
            if len(v) != n:
                raise ValueError(f"field {name!r} of sample {i} has {len(v)} values, sequence has {n} tokens")
        parts = [torch.as_tensor(v, device=device)[first:] for v, first in zip(values, starts, strict=True)]
        dtype = torch.bool if all(part.dtype == torch.bool for part in parts) else torch.float32
        fields[name] = torch.cat([part.to(dtype) for part in parts])
    return fields


def _build_shared_prompt_batch(sequences: Sequence[Sequence[int]], token_fields: Mapping[str, Sequence],
                               device: torch.device | str | None, prompt_lengths: Sequence[int]) -> PackedBatch:
    if len(prompt_lengths) != len(sequences):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(sequences)} sequences")
    ids, positions, seq_ids, tree_ids, prev = [], [], [], [], []
    shared: list[bool] = []
    starts = []  # the first token of each sequence that is packed (after a shared prompt: its completion's)
    # the prompt that the next sequence may share: its tokens, its first and last token's index, its tree
    trunk: tuple[tuple[int, ...], int, int, int] | None = None
    trees = 0
    for i, seq in enumerate(sequences):
        p = prompt_lengths[i]
        if not 0 <= p <= len(seq):
            raise ValueError(f"sample {i}: prompt length {p} outside its {len(seq)} tokens")
        shareable = 0 < p < len(seq)  # (one with no completion keeps its prompt and leaves the trunk as it is)
        joins = shareable and trunk is not None and tuple(seq[:p]) == trunk[0]
        if joins:
            first, tree = p, trunk[3]
            shared[trunk[1]:trunk[2] + 1] = [True] * p
        else:
            first, tree, trees = 0, trees, trees + 1
            if shareable:
                trunk = (tuple(seq[:p]), len(ids), len(ids) + p - 1, tree)
        starts.append(first)
        for j in range(first, len(seq)):
            prev.append(trunk[2] if joins and j == p else len(ids) - 1)
            ids.append(seq[j])
            positions.append(j)
            seq_ids.append(i)
            tree_ids.append(tree)
            shared.append(False)
    fields = _packed_fields(token_fields, [len(seq) for seq in sequences], starts, device)
    lengths = [len(seq) - first for seq, first in zip(sequences, starts)]
    cu = _cu_seqlens(lengths, device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device)[None], position_ids=pos[None],
        seq_ids=torch.tensor(seq_ids, dtype=torch.long, device=device), cu_seqlens=cu, label_mask=pos > 0,
        lengths=lengths, fields=fields, tree_ids=torch.tensor(tree_ids, dtype=torch.long, device=device),
        shared=torch.tensor(shared, dtype=torch.bool, device=device),
        prev_index=torch.tensor(prev, dtype=torch.long, device=device))


def packed_causal_mask(seq_ids: Tensor, tree_ids: Tensor | None = None, shared: Tensor | None = None) -> Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` (bool, True = may attend) from per-token sequence ids.

    ``mask[0, 0, q, k] = seq_ids[q] == seq_ids[k] and k <= q``; with shared prompts (``tree_ids``, ``shared``
    of a :class:`PackedBatch`), also where ``k`` is a prompt token of ``q``'s tree that its sequences share.
    Pass it as ``attention_mask`` with ``attn_implementation="sdpa"``; for ``"eager"`` convert it with
    :func:`to_additive_mask` first. It is a ``T x T`` tensor: for long rows prefer flash-attention with
    ``position_ids`` only.
    """
    seq_ids = seq_ids.reshape(-1)
    # built on every forward: one [T, T] tensor made causal in place, half the time of a tril() and an &
    same = seq_ids[:, None] == seq_ids[None, :]
    if tree_ids is not None:
        same |= (tree_ids[:, None] == tree_ids[None, :]) & shared[None, :]
    return same.tril_()[None, None]


def to_additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = attend) -> additive float mask (0 where attend, dtype's min elsewhere) for eager."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def is_flash_attention(impl: str | None) -> bool:
    """Whether ``impl`` (a model's ``config._attn_implementation``) is a flash-attention varlen kernel."""
    return impl is not None and "flash" in impl


AttentionMode = Literal["auto", "mask", "position_ids", "padded"]


def padded_rows(batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """The packed row's sequences as right-padded rows, ``[N, L]`` token ids (L its longest sequence, padding
    id 0), and where each packed token lies in them flattened, ``[T]``: packed token ``t`` is
    ``rows.view(-1)[index[t]]``, and ``index[t] - 1`` is the token before it in its sequence."""
    width = batch.max_seqlen
    index = batch.seq_ids * width + batch.position_ids[0]
    rows = batch.input_ids.new_zeros(batch.num_sequences * width)
    rows[index] = batch.input_ids[0]
    return rows.view(batch.num_sequences, width), index


def _linear_macs(config) -> tuple[int, int]:
    """Multiply-adds per token of a decoder layer's linear layers, ``h * (2h + 2 kv + 3 i)`` (q and o, k and v,
    the gated MLP), and the hidden size ``h``: attention takes ``2h`` per key attended (scores, then values)."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_dim = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return h * (2 * h + 2 * kv_dim + 3 * getattr(config, "intermediate_size", 4 * h)), h


def _unshared_cost(lengths: Sequence[int], config) -> int:
    """Multiply-adds per layer of sequences of ``lengths`` in the cheaper of their two unshared layouts (see
    :func:`padded_is_cheaper`): right-padded rows (where they are at most twice the tokens) or one row under the
    dense mask."""
    linear, h = _linear_macs(config)
    tokens, width, n = sum(lengths), max(lengths), len(lengths)
    dense = tokens * (linear + 2 * h * tokens)
    if n * width > 2 * tokens:
        return dense
    return min(dense, n * width * (linear + h * width))  # 2h per key, width / 2 keys on average


def padded_is_cheaper(batch: PackedBatch, config) -> bool:
    """Whether the packed row's sequences cost less as right-padded rows (causal attention over each row, the
    padding computed and dropped) than as one row under a dense ``[T, T]`` mask, in multiply-adds per layer.

    Per token, the linear layers take ``h * (2h + 2 kv + 3 i)`` (q and o, k and v, the gated MLP); attention
    takes ``2h`` per key attended (scores, then values): ``T`` keys under the dense mask (masked keys are still
    computed), ``L / 2`` on average under a causal one. Padded rows are also held to at most twice the packed
    tokens, so they never take much more activation memory than ``micro_batch_tokens`` planned for."""
    tokens = batch.input_ids.shape[1]
    if batch.num_sequences == 1:
        return True  # one sequence: its row is the packed row, and the causal kernel needs no mask
    linear, h = _linear_macs(config)
    return _unshared_cost(batch.lengths, config) < tokens * (linear + 2 * h * tokens)


def shared_prompts_are_cheaper(lengths: Sequence[int], shared_tokens: int, config) -> bool:
    """Whether sequences of ``lengths`` tokens (prompt and completion each) cost less as one row of
    ``shared_tokens`` with their common prompts shared, under the dense mask it needs, than in the cheaper of
    their unshared layouts; in multiply-adds per layer, as :func:`padded_is_cheaper`. Short answers to long
    prompts (the tiny recipe's groups: 41 tokens instead of 104) gain; long answers, whose attention under a
    dense mask costs more than the prompts saved, do not."""
    if shared_tokens >= sum(lengths):
        return False
    linear, h = _linear_macs(config)
    return shared_tokens * (linear + 2 * h * shared_tokens) < _unshared_cost(lengths, config)


def resolve_attention(batch: PackedBatch, impl: str | None, attention: AttentionMode, config) -> str:
    """The mode a forward on ``batch`` runs in: ``"auto"`` is ``"position_ids"`` for flash-attention (varlen
    kernels, no mask), else ``"padded"`` where :func:`padded_is_cheaper`, else ``"mask"``."""
    if batch.shares_prompts:  # only a mask says which tokens a completion sees
        if attention not in ("auto", "mask") or impl not in ("sdpa", "eager"):
            raise ValueError(f"a packed row with shared prompts needs attention 'mask' with sdpa or eager, not "
                             f"{attention!r} with {impl!r}")
        return "mask"
    if attention != "auto":
        return attention
    if impl not in ("sdpa", "eager"):
        return "position_ids"
    return "padded" if config is not None and padded_is_cheaper(batch, config) else "mask"


def packed_model_inputs(batch: PackedBatch, impl: str | None, attention: AttentionMode, config,
                        mask_dtype: torch.dtype = torch.float32) -> tuple[dict, Tensor | None]:
    """The keyword arguments of a causal LM's forward on ``batch`` (``input_ids`` included), and, for padded
    rows, where each packed token's output lies in the forward's flattened ``[N * L]`` outputs (None: the
    outputs are the packed row's own, ``[T]``)."""
    mode = resolve_attention(batch, impl, attention, config)
    if mode == "padded":
        rows, index = padded_rows(batch)
        return {"input_ids": rows, "use_cache": False}, index
    return {"input_ids": batch.input_ids, **packed_forward_kwargs(batch, impl, mode, mask_dtype)}, None


def packed_forward_kwargs(
    batch: PackedBatch,
    impl: str | None,
    attention: Literal["auto", "mask", "position_ids"] = "auto",
    mask_dtype: torch.dtype = torch.float32,
) -> dict:
    """Keyword arguments for a causal LM's forward on a packed row, for attention implementation ``impl``.

    ``"mask"`` passes :func:`packed_causal_mask` (bool for sdpa, additive ``mask_dtype`` for eager);
    ``"position_ids"`` passes no mask (transformers detects packing from the restarting positions), plus, for
    flash-attention, the varlen ``cu_seq_lens``/``max_length`` arguments. ``"auto"`` uses the mask for
    sdpa/eager and no mask otherwise. ``use_cache=False`` always (a cache disables packing detection).
    """
    if attention == "auto":
        attention = "mask" if impl in ("sdpa", "eager") else "position_ids"
    if batch.shares_prompts and attention != "mask":
        raise ValueError(f"a packed row with shared prompts needs attention 'mask', not {attention!r}")
    if attention == "padded":
        raise ValueError("attention 'padded' changes the forward's input ids: use packed_model_inputs")
    kwargs: dict = {"position_ids": batch.position_ids, "use_cache": False}
    if attention == "mask":
        mask = packed_causal_mask(batch.seq_ids, batch.tree_ids, batch.shared)
        if impl == "eager":
            mask = to_additive_mask(mask, mask_dtype)
        elif impl != "sdpa":
            raise ValueError(f"a 4-D mask is only supported here for sdpa or eager attention, not {impl!r}")
        kwargs["attention_mask"] = mask
    elif attention != "position_ids":
        raise ValueError(f"unknown attention mode {attention!r}")
    elif is_flash_attention(impl):
        kwargs.update(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
                      max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    return kwargs
