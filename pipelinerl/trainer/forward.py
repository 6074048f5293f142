"""The trainer's forward passes over packed rows (`pipelinerl.rl.packing` lays the rows out): the attention
implementation to load the models with, and the log-probs and entropy of a packed row through a causal LM.

Log-probs never materialise ``[T, vocab]`` logits (:func:`packed_logprobs_and_entropy`): the decoder's final
hidden states go through the LM head a chunk of tokens at a time, and the backward recomputes each chunk.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelinerl.rl.packing import AttentionMode, PackedBatch, packed_model_inputs
from pipelinerl.trainer import linear_kernels

log = logging.getLogger(__name__)

FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation"


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


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, out: Tensor,
                   onednn: bool = False) -> Tensor:
    """``out = float32(hidden @ weight^T + bias) / temperature``, the matmul in ``weight``'s dtype (the compute
    dtype): as the LM head under autocast, then the float32 upcast of :func:`logprobs_from_logits`. ``out`` is
    a reused ``[rows, vocab]`` float32 buffer (fresh ones cost page faults on CPU, allocator churn on GPU).
    ``onednn``: the float32 product by oneDNN, where the head's layer was routed there (linear_kernels.py)."""
    with torch.autocast(hidden.device.type, enabled=False):
        rows = hidden.to(weight.dtype)
        if weight.dtype != torch.float32:
            out.copy_(F.linear(rows, weight, bias))
        elif onednn:  # oneDNN writes a fresh tensor: one [rows, vocab] copy, against rows x hidden MACs per entry
            out.copy_(linear_kernels.onednn_linear(rows, weight, bias))
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
    ``onednn``: the three products (logits, hidden and weight gradients) by oneDNN, float32 only: the choice
    ``trainer.linear_kernel`` made for the head's layer, which this function multiplies without calling it.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk_tokens: int, compute_dtype: torch.dtype, with_entropy: bool,
                entropy_grad: bool = False, onednn: bool = False) -> tuple[Tensor, Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        f32 = {"dtype": torch.float32, "device": hidden.device}
        logprobs, lse = torch.empty(n, **f32), torch.empty(n, **f32)
        entropy = torch.empty(n if with_entropy else 0, **f32)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        onednn = onednn and compute_dtype == torch.float32
        rows = min(chunk_tokens, n)
        logits_buf, exp_buf = torch.empty(rows, vocab, **f32), torch.empty(rows, vocab, **f32)
        for start in reversed(range(0, n, chunk_tokens)):  # last to first: see the class docstring
            end = min(start + chunk_tokens, n)
            logits = _scaled_logits(hidden[start:end], w, b, temperature, logits_buf[:end - start], onednn)
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
        ctx.onednn = onednn
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
                    grad_logits = _scaled_logits(rows, w, b, temperature, logits_buf[:end - start], ctx.onednn)
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
                    grad_hidden[start:end] = (linear_kernels.onednn_linear(grad_raw, w.t()) if ctx.onednn
                                              else grad_raw @ w)
                if need_weight:
                    if ctx.onednn:  # dz^T @ rows, added: oneDNN writes a fresh [V, H] (one add per chunk)
                        grad_weight += linear_kernels.onednn_linear(grad_raw.t(), rows.t())
                    elif grad_weight.dtype == compute:
                        grad_weight.addmm_(grad_raw.t(), rows)
                    else:
                        grad_weight += grad_raw.t() @ rows
                if need_bias:
                    grad_bias += grad_raw.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


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

    # the head's layer routed through oneDNN (trainer.linear_kernel) on the CPU: its chunks multiply there too
    head_on_onednn = linear_kernels.is_routed(head) and head.weight.device.type == "cpu"

    def chunked_head(hidden_states: Tensor) -> Tensor:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])[before]
        logprobs, entropy = ChunkedHeadLogprobs.apply(rows, head.weight, head.bias, targets, temperature,
                                                      chunk_tokens, _compute_dtype(head.weight), with_entropy,
                                                      entropy_grad, head_on_onednn)
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
