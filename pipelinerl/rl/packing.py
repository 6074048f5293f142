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

Log-probs never materialise ``[T, vocab]`` logits (:func:`packed_logprobs_and_entropy`): the decoder's final
hidden states go through the LM head a chunk of tokens at a time, and the backward recomputes each chunk.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation"


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


def resolve_attn_implementation(requested: str, device: torch.device | str,
                                micro_batch_tokens: int | None = None) -> str:
    """The attention implementation to load the trainer's models with; ``"auto"`` picks one for ``device``.

    ``"auto"`` is ``flash_attention_2`` on a CUDA device when ``flash_attn`` imports (packed rows then never
    build a ``[T, T]`` mask), else ``sdpa``; on a CUDA device without flash-attn it logs a warning with the
    install command and what the dense mask costs at ``micro_batch_tokens``. Any other value is returned as is.
    """
    if requested != "auto":
        return requested
    if torch.device(device).type != "cuda":
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    try:
        import flash_attn  # noqa: F401  (imports the CUDA extension: an ABI mismatch with torch fails here)

        if not is_flash_attn_2_available():  # transformers' own test: the flash-attn 2 distribution, >= 2.3.3
            raise ImportError("transformers does not accept the installed flash_attn as flash-attention 2")
    except ImportError as e:
        cost = ""
        if micro_batch_tokens:
            # transformers' sdpa path: our bool mask, then sdpa's additive bf16 copy of it (3 bytes per pair)
            cost = f" ({3 * micro_batch_tokens ** 2 / 2 ** 30:.2f} GiB at micro_batch_tokens={micro_batch_tokens})"
        log.warning("trainer.attn_implementation=auto: flash-attn is not usable (%s), so packed micro-batches use "
                    "sdpa with a dense [tokens x tokens] attention mask%s and sdpa's slower masked kernels. "
                    "Install it with `%s` (built against the installed torch), or set "
                    "trainer.attn_implementation explicitly to silence this.", e, cost, FLASH_ATTN_INSTALL)
        return "sdpa"
    return "flash_attention_2"


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a DDP / DeepSpeed wrapper (an FSDP2 or plain model is its own). DeepSpeed's
    engine forwards unknown attributes to its module, so unwrap by `.module` rather than by what is found."""
    inner = model
    while isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    if not hasattr(inner, "get_output_embeddings"):
        raise TypeError(f"{type(model).__name__} is not a transformers causal LM (no get_output_embeddings)")
    return inner


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


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, out: Tensor) -> Tensor:
    """``out = float32(hidden @ weight^T + bias) / temperature``, the matmul in ``weight``'s dtype (the compute
    dtype): as the LM head under autocast, then the float32 upcast of :func:`logprobs_from_logits`. ``out`` is
    a reused ``[rows, vocab]`` float32 buffer (fresh ones cost page faults on CPU, allocator churn on GPU)."""
    with torch.autocast(hidden.device.type, enabled=False):
        rows = hidden.to(weight.dtype)
        if weight.dtype != torch.float32:
            out.copy_(F.linear(rows, weight, bias))
        elif bias is None:
            torch.mm(rows, weight.t(), out=out)
        else:
            torch.addmm(bias, rows, weight.t(), out=out)
    return out.div_(temperature) if temperature != 1.0 else out


class ChunkedHeadLogprobs(torch.autograd.Function):
    """Log-prob of a target per row of ``hidden @ weight^T (+ bias)`` at a temperature, and the entropy of that
    distribution (differentiable when ``entropy_grad``, for an entropy bonus), computed ``chunk_tokens`` rows at
    a time.

    Only one chunk's ``[chunk, vocab]`` float32 logits exist at a time (two buffers of that size in the
    forward, one in the backward), which recomputes them from the saved hidden states: one extra matmul per
    chunk, the fused-linear cross-entropy trade. Saved for backward: ``hidden``, the parameters, one float32
    per row, and the forward's logits buffer, which the backward needs anyway: the forward visits the chunks
    last to first, so the buffer ends up holding the first chunk's logits and the backward, which visits them
    first to last, starts from those instead of recomputing them (no recomputation at all when the rows fit in
    one chunk; the same peak memory, the same results, the chunks still summed into the gradients in order).

    ``apply(hidden [N, H], weight [V, H], bias [V] | None, targets [N], temperature, chunk_tokens,
    compute_dtype, with_entropy, entropy_grad) -> (logprobs [N], entropy [N] or [0])``, both float32. With
    ``entropy_grad`` the backward needs a second ``[chunk, vocab]`` buffer. The matmuls run in
    ``compute_dtype`` (the autocast dtype when the caller runs under autocast, else the weight's), the
    softmax in float32. The weight gradient is accumulated over chunks in the weight's dtype (in place when
    that is the compute dtype; else each chunk's ``[V, H]`` product is added, as autocast's cast back did).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk_tokens: int, compute_dtype: torch.dtype, with_entropy: bool,
                entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        f32 = {"dtype": torch.float32, "device": hidden.device}
        logprobs, lse = torch.empty(n, **f32), torch.empty(n, **f32)
        entropy = torch.empty(n if with_entropy else 0, **f32)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        rows = min(chunk_tokens, n)
        logits_buf, exp_buf = torch.empty(rows, vocab, **f32), torch.empty(rows, vocab, **f32)
        for start in reversed(range(0, n, chunk_tokens)):  # last to first: see the class docstring
            end = min(start + chunk_tokens, n)
            logits = _scaled_logits(hidden[start:end], w, b, temperature, logits_buf[:end - start])
            picked = logits.gather(1, targets[start:end, None]).squeeze(1)
            top = logits.amax(1, keepdim=True)
            exp = torch.sub(logits, top, out=exp_buf[:end - start]).exp_()
            total = exp.sum(1)
            chunk_lse = top.squeeze(1) + total.log()
            lse[start:end] = chunk_lse
            logprobs[start:end] = picked - chunk_lse
            if with_entropy:  # H = lse - sum_v softmax_v * z_v, as entropy_from_logits
                entropy[start:end] = chunk_lse - exp.mul_(logits).sum(1) / total
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if ctx.entropy_grad else None)
        ctx.temperature, ctx.chunk_tokens, ctx.compute_dtype = temperature, chunk_tokens, compute_dtype
        # the first chunk's logits, untouched since (the softmax went to exp_buf), for the backward to start from
        ctx.first_chunk_logits = logits_buf if n and any(ctx.needs_input_grad[:3]) else None
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute, temperature, chunk_tokens = ctx.compute_dtype, ctx.temperature, ctx.chunk_tokens
        n, vocab = hidden.shape[0], weight.shape[0]
        w = weight.to(compute)
        b = bias.to(compute) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        grad = grad_logprobs.float()
        with_h = ctx.entropy_grad and grad_entropy is not None
        grad_h = grad_entropy.float() if with_h else None
        # taken, not kept: the loop below overwrites it, so another backward through this graph (retain_graph)
        # recomputes every chunk
        logits_buf, ctx.first_chunk_logits = ctx.first_chunk_logits, None
        first_ready = logits_buf is not None
        if logits_buf is None:
            logits_buf = torch.empty(min(chunk_tokens, n), vocab, dtype=torch.float32, device=hidden.device)
        coef_buf = torch.empty_like(logits_buf) if with_h else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_tokens):
                end = min(start + chunk_tokens, n)
                g, rows = grad[start:end, None], hidden[start:end].to(compute)
                # d logprob / d z = onehot(target) - softmax(z), built in place on the recomputed logits; with the
                # entropy's gradient dH / dz = -softmax(z) * (log softmax(z) + H) added:
                # grad_z = onehot * g - p * (g + g_H * (log p + H))
                if start == 0 and first_ready:  # the forward's own logits of this chunk
                    grad_logits = logits_buf[:end - start]
                else:
                    grad_logits = _scaled_logits(rows, w, b, temperature, logits_buf[:end - start])
                log_p = grad_logits.sub_(lse[start:end, None])
                if with_h:
                    g_h = grad_h[start:end, None]
                    coef = torch.mul(log_p, g_h, out=coef_buf[:end - start]).add_(g + g_h * entropy[start:end, None])
                    grad_logits = log_p.exp_().mul_(coef).neg_()
                else:
                    grad_logits = log_p.exp_().mul_(-g)
                grad_logits.scatter_add_(1, targets[start:end, None], g)
                if temperature != 1.0:
                    grad_logits.div_(temperature)
                grad_raw = grad_logits.to(compute)  # the same buffer when computing in float32
                if need_hidden:
                    grad_hidden[start:end] = grad_raw @ w
                if need_weight:
                    if grad_weight.dtype == compute:
                        grad_weight.addmm_(grad_raw.t(), rows)
                    else:
                        grad_weight += grad_raw.t() @ rows
                if need_bias:
                    grad_bias += grad_raw.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The LM head's matmul dtype: autocast's where the caller enabled it, else the weight's."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


@contextlib.contextmanager
def _lm_head_replaced(head: nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[list[Tensor]]:
    """Run ``forward`` in place of the LM head's own for the duration, yielding the head's outputs as the
    model saw them (after every forward hook, e.g. ZeRO-3's, which wraps the output for its backward hook).

    The head is still *called* by the model's forward, so whatever the wrapper hooks onto it runs as usual:
    ZeRO-3 gathers the weight before the call and again before its backward; FSDP has it unsharded as part
    of the root module; a tied embedding is the same parameter."""
    outputs: list[Tensor] = []
    saved = head.__dict__.get("forward")
    head.forward = forward
    handle = head.register_forward_hook(lambda _m, _i, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def packed_logprobs_and_entropy(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    attention: AttentionMode = "auto",
    chunk_tokens: int = 1024,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-prob of every token of a packed row given the earlier tokens of its own sequence, and the entropy of
    the distribution it was sampled from; both ``[T]`` float32, aligned with ``input_ids``.

    ``logprobs[t] = log softmax(z_{t-1} / temperature)[input_ids[t]]`` and ``entropy[t]`` the entropy of that
    same softmax, where ``z_{t-1}`` are the logits after token t-1 of t's sequence. Both are 0 at the first
    token of each sequence (``batch.label_mask`` False). Gradients flow to the model through ``logprobs``, and
    through ``entropy`` when ``entropy_grad`` (an entropy bonus); else ``entropy`` is detached, or all zeros when
    ``with_entropy`` is False.

    ``model`` is a transformers causal LM, bare or wrapped (DDP, DeepSpeed, FSDP2): it is called as usual,
    but its LM head computes only :class:`ChunkedHeadLogprobs`, ``chunk_tokens`` rows at a time, so no
    ``[T, vocab]`` logits exist in the forward or the backward. ``attention``: how the sequences go through
    the model (:func:`resolve_attention`; ``"auto"`` picks the cheapest exact one). Raises ValueError for a
    model that transforms its head's output (logit soft-capping or scaling): those logits would not be the ones
    sampled from.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    causal_lm = _causal_lm(model)
    head = causal_lm.get_output_embeddings()
    config = getattr(causal_lm, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    kwargs, index = packed_model_inputs(batch, impl, attention, config, next(causal_lm.parameters()).dtype)
    positions = batch.label_mask.nonzero().squeeze(1)  # tokens t to score, each predicted from row t - 1
    targets = batch.input_ids[0, positions]
    if batch.prev_index is not None:  # shared prompts: a completion's first token comes after the prompt's last
        before = batch.prev_index[positions]
    else:  # the output row predicting each target
        before = positions - 1 if index is None else index[positions] - 1

    def chunked_head(hidden_states: Tensor) -> Tensor:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])[before]
        logprobs, entropy = ChunkedHeadLogprobs.apply(rows, head.weight, head.bias, targets, temperature,
                                                      chunk_tokens, _compute_dtype(head.weight), with_entropy,
                                                      entropy_grad)
        return torch.stack([logprobs, entropy], 1) if with_entropy else logprobs[:, None]

    with _lm_head_replaced(head, chunked_head) as head_outputs:
        out = model(**kwargs)
    # `out.logits` is what the head returned, passed through the wrappers' hooks (ZeRO-3 and FSDP hook the
    # model's outputs to gather parameters in the backward): the result must be taken from it, not the head.
    per_row = out.logits
    if (len(head_outputs) != 1 or per_row.shape != head_outputs[0].shape
            or not torch.equal(per_row.detach(), head_outputs[0].detach())):
        raise ValueError(f"{type(causal_lm).__name__} transforms its LM head's output (logit soft-capping or "
                         "scaling?) or calls the head more than once; chunked log-probs support plain heads only")
    zeros = per_row.new_zeros(batch.input_ids.shape[1])
    logprobs = zeros.index_put((positions,), per_row[:, 0])
    if with_entropy:
        entropy = zeros.index_put((positions,), per_row[:, 1] if entropy_grad else per_row[:, 1].detach())
    else:
        entropy = zeros
    return logprobs, entropy


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    attention: AttentionMode = "auto",
    chunk_tokens: int = 1024,
) -> Tensor:
    """Log-prob of every token of a packed row given the earlier tokens of its own sequence, shape ``[T]``.

    ``out[t] = log p(input_ids[t] | input_ids[start(t):t])``, aligned with ``input_ids`` (so with per-token
    advantages and behaviour log-probs); ``out`` is 0 at the first token of each sequence
    (``batch.label_mask`` False). Gradients flow to the model. See
    :func:`packed_logprobs_and_entropy` (chunked LM head, no ``[T, vocab]`` logits) and
    :func:`resolve_attention` (``attention``).
    """
    return packed_logprobs_and_entropy(model, batch, temperature, attention, chunk_tokens, with_entropy=False)[0]
