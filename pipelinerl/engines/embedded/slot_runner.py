"""`SlotRunner`: forward passes with a per-sequence KV cache, for continuous batching of the Llama family.

The fast path for the Llama family (Llama, Qwen2, Qwen3, Mistral without sliding window; model_runner.py's
`supports_fast_path`): it runs the layers of the Hugging Face model with its own weights but its own, leaner
forward. The KV cache is one tensor per layer, seen as keys and values [slots, kv_heads, max_len, head_dim];
running sequences occupy slots 0..B-1 contiguously (a finished sequence's slot is refilled by moving the last
one), so a decode step attends over a view of the cache, not a gathered copy. What makes it fast on small
batches, where per-op overhead and not arithmetic dominates:
- q/k/v projections share one matmul, and so do the MLP's gate and up projections: at construction the
  model's parameters are re-pointed to row slices of one fused buffer per group, so there is no second copy
  of the weights and an in-place write to a parameter (what a weight switch does) lands in the fused buffer;
- the rotary cos/sin of every position are computed once (the same values the model's rotary module gives),
  and q and k are rotated together;
- a decode step attends with the query heads of each kv head grouped as that head's queries, which avoids
  repeating the keys for grouped-query attention; on CPU, with keys stored transposed, the scores are one
  plain batched matmul;
- a decode step builds its cache write offsets (and, only when lengths differ, its attention mask) once for
  all layers; the last layer's output projection and MLP run on the last prompt position only during
  prefill; RMSNorm is five ops on CPU, where F.rms_norm runs as about ten;
- on CPUs, each weight shape is multiplied through a copy stored transposed or packed, or as stored, by the
  kernel (BLAS or oneDNN) timed fastest for it on this machine when the runner is built (linear_kernels.py's
  `LinearKernels`; see "weights stored transposed" below); PIPELINERL_ONEDNN=0 leaves oneDNN out,
  PIPELINERL_PACKED_WEIGHTS=0 the packed copies;
- prompts admitted together are prefilled in one padded forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipelinerl.engines.embedded.linear_kernels import LinearKernels, onednn_usable
from pipelinerl.engines.embedded.packed import PackedLayout
from pipelinerl.engines.embedded.transpose import relayout_copier, relayout_copy

TRANSPOSED_CHOICES = ("auto", "all", "none", "packed")
# Padded tokens per prefill forward: bounds the activations of a batched prefill and the padding it wastes.
PREFILL_CHUNK_TOKENS = 4096
# Largest table of per-position rotations for every fused q/k/v head kept precomputed (see `_step_rope`).
ROPE_TABLE_BYTES = 16 << 20


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest
_TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory mapped instead of returning it to the kernel, process-wide.

    Every forward allocates its activations afresh (the CPU allocator does not cache). With glibc's defaults,
    blocks from 128 KiB up are mmapped per allocation, and freed heap tops are trimmed back to the kernel
    (in the engine thread's arena, after every batched prefill), so the next forward faults every page in
    again, a visible share of a small model's batched prefill. Returns whether the settings took (False off glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))



# A buffer shared by several parameters: (buffer, [(parameter, first row, end row)]).
FusedGroup = tuple[torch.Tensor, list[tuple[torch.nn.Parameter, int, int]]]


def _fuse_rows(modules: Sequence[torch.nn.Linear], groups: list[FusedGroup]) -> tuple[torch.Tensor,
                                                                                      torch.Tensor | None]:
    """One weight (and bias) buffer for linears that share their input, with each module's parameters
    re-pointed to a row slice of it: the same values, no extra copy, and in-place writes stay visible.
    The buffers are recorded in `groups` (a weight switch that replaces storage must re-point the slices)."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in modules])
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features)
                              for m, b in zip(modules, biases)])
        weight_members, bias_members = [], []
        row = 0
        for m in modules:
            n = m.out_features
            m.weight.data = weight[row:row + n]
            weight_members.append((m.weight, row, row + n))
            if m.bias is not None:
                m.bias.data = bias[row:row + n]
                bias_members.append((m.bias, row, row + n))
            row += n
    groups.append((weight, weight_members))
    if bias is not None:
        groups.append((bias, bias_members))
    return weight, bias


@dataclass
class _Norm:
    """An RMSNorm module and what its forward reads, looked up once (the parameter object stays the same
    across weight switches, which replace its data)."""

    module: torch.nn.Module
    weight: torch.Tensor
    shape: tuple[int]
    eps: float
    eps_t: torch.Tensor  # eps as a 0-d tensor, for addcmul

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Norm:
        w = module.weight
        eps = module.variance_epsilon
        return cls(module, w, (w.shape[-1],), eps, torch.tensor(eps, dtype=w.dtype, device=w.device))


class _RowsOperand:
    """What the rows of a packed weight's product that are not multiplied by the packed copy (LinearKernels'
    `use_live`) are multiplied by: `weight`, the weight as stored, or (a relayout slot of its own) its transposed
    copy. Every view of the packed copy refers to it (packed.py's `PackedLayout.view`)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


@dataclass
class _Layer:
    """One decoder layer's weights as the fast path uses them (views of the model's parameters)."""

    input_norm: _Norm
    post_norm: _Norm
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.nn.Module | None  # Qwen3 normalises q and k per head before the rotation
    k_norm: torch.nn.Module | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    mlp: torch.nn.Module
    gate_up_w: torch.Tensor | None  # None: an activation other than SiLU, the MLP module runs as is
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None


class SlotRunner:
    """The Llama family's forward over slots 0..num_slots-1 of one KV cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, onednn: bool | None = None,
                 choose_kernels: Callable[[list[tuple[int, int, bool]]], LinearKernels] | None = None,
                 transposed: str = "auto"):
        """`onednn`: whether oneDNN linears may be chosen (default: where usable, see `onednn_usable`).
        `choose_kernels(shapes)`: how the weights of these (out, in, has bias) shapes are multiplied.
        By default `LinearKernels.timed` on a CPU with float32 weights; elsewhere every weight stays as it is
        and goes through F.linear. `transposed`: "auto" keeps transposed or packed copies of the weights where
        that was chosen, "all" transposed copies of every weight multiplied, "none" no copy (no second copy of
        the weights in memory), "packed" packed copies of every float32 weight whose shape allows one here
        (untimed: `LinearKernels.fixed`), the others as stored."""
        if transposed not in TRANSPOSED_CHOICES:
            raise ValueError(f"transposed must be one of {', '.join(TRANSPOSED_CHOICES)}, not {transposed!r}")
        self.model = model
        self.inner = model.model
        cfg = model.config
        attn0 = self.inner.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn0.scaling
        self.gqa = self.num_kv_heads != self.num_heads
        self.num_slots, self.max_len = num_slots, max_len
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.onednn = onednn_usable(self.device, self.dtype) if onednn is None else onednn
        if self.device.type == "cpu":
            keep_freed_memory()
        self.fused_groups: list[FusedGroup] = []
        self.layers = [self._fast_layer(layer, cfg) for layer in self.inner.layers]
        self._embed_w = self.inner.embed_tokens.weight
        self._final_norm = _Norm.of(self.inner.norm)
        self._head_w, self._head_b = model.lm_head.weight, model.lm_head.bias
        kernels = None
        if choose_kernels is not None:
            kernels = choose_kernels(self._linear_shapes())
        elif transposed == "packed":
            on = self.device.type == "cpu" and self.dtype == torch.float32 and self.onednn
            kernels = LinearKernels.fixed(self._linear_shapes(), packed=on)
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            kernels = LinearKernels.timed(self._linear_shapes(), self.dtype, self.device, onednn=self.onednn)
        self.linear: LinearKernels | Callable = F.linear
        # (holder, attribute, live weight) of every weight the runner multiplies with a copy, and the copy's
        # layout ("transposed" or "packed": `relayout_copier`)
        self.relayout_slots: list[tuple[object, str, torch.Tensor]] = []
        self.relayout_layouts: list[str] = []
        # by slot of a packed copy: its layout, and what the rows that are not multiplied by it are multiplied by
        self._packed_layouts: dict[int, tuple[PackedLayout, _RowsOperand]] = {}
        self._retired: dict[int, torch.Tensor] = {}  # copies `use_copies` replaced, by slot: the next ones' memory
        # ids of copies in use that another process wrote (receiving_process.py) and may write again: never retired here
        self._foreign: set[int] = set()
        if kernels is not None:
            if transposed in ("all", "none"):
                kernels.without_packed()
                kernels.transposed = set(kernels.use_onednn) if transposed == "all" else set()
            self._relayout_slots(kernels)
            self.use_weights(self.transposed_weights())
            if kernels.any_onednn:  # else F.linear itself: no lookup per call
                self.linear = kernels
        self.linear_kernels = kernels.summary() if kernels is not None else "blas (F.linear), untimed"
        self.manual_attention = self.device.type == "cpu"
        self._init_kv_cache(keys_transposed=self.manual_attention)
        self._cos, self._sin = self._rotary_tables()
        self._rope = torch.stack((self._cos, self._sin), 1)  # [max_len, 2, head_dim]
        self._rope_heads = self._fused_rope_table()
        heads = self.num_heads + 2 * self.num_kv_heads
        self._step_rope = torch.zeros(2, num_slots, heads, self.head_dim, dtype=self.dtype, device=self.device)
        self._step_rope[0] = 1.0
        self._no_bias = torch.zeros(1, 1, 1, dtype=self.dtype, device=self.device)

    # --- construction --------------------------------------------------------------------------------------

    def _fast_layer(self, layer: torch.nn.Module, cfg) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj], self.fused_groups)
        gate_up_w = gate_up_b = down_w = down_b = None
        if getattr(cfg, "hidden_act", None) == "silu" and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj",
                                                                                         "down_proj")):
            gate_up_w, gate_up_b = _fuse_rows([mlp.gate_proj, mlp.up_proj], self.fused_groups)
            down_w, down_b = mlp.down_proj.weight, mlp.down_proj.bias
        return _Layer(input_norm=_Norm.of(layer.input_layernorm), post_norm=_Norm.of(layer.post_attention_layernorm),
                      qkv_w=qkv_w, qkv_b=qkv_b, q_norm=getattr(attn, "q_norm", None),
                      k_norm=getattr(attn, "k_norm", None), o_w=attn.o_proj.weight, o_b=attn.o_proj.bias,
                      mlp=mlp, gate_up_w=gate_up_w, gate_up_b=gate_up_b, down_w=down_w, down_b=down_b)

    def _linears(self) -> list[tuple[object, str, torch.Tensor, torch.Tensor | None]]:
        """(holder, attribute, weight, bias) of every linear that goes through `self.linear`."""
        linears: list[tuple[object, str, torch.Tensor, torch.Tensor | None]] = [
            (self, "_head_w", self._head_w, self._head_b)]
        for layer in self.layers:
            linears += [(layer, "qkv_w", layer.qkv_w, layer.qkv_b), (layer, "o_w", layer.o_w, layer.o_b)]
            if layer.gate_up_w is not None:
                linears += [(layer, "gate_up_w", layer.gate_up_w, layer.gate_up_b),
                            (layer, "down_w", layer.down_w, layer.down_b)]
        return linears

    def _linear_shapes(self) -> list[tuple[int, int, bool]]:
        """(out, in, has bias) of every weight that goes through `self.linear`."""
        return [(w.shape[0], w.shape[1], b is not None) for _, _, w, b in self._linears()]

    def _relayout_slots(self, kernels: LinearKernels) -> None:
        """Where the weights of the shapes `kernels` multiplies by copies are read from: (holder, attribute, live
        weight), and each copy's layout. A weight with both a packed and a transposed copy has two slots: the
        transposed copy's holder is the `_RowsOperand` of the packed one. A head tied to the embedding gets
        copies like any weight of its shape, while the embedding's lookups go on reading the live weight row by
        row (`_embed_w`). One row at a time its copy matters most: a [vocab, hidden] head streams from memory
        faster as its transposed copy than as stored, and at small models it is a large share of a decode step."""
        for holder, attr, w, _ in self._linears():
            key = (w.shape[0], w.shape[1])
            transposed = key in kernels.transposed
            if key in kernels.packed:
                rows = _RowsOperand(w)
                self._packed_layouts[len(self.relayout_slots)] = (PackedLayout.of(*key), rows)
                self.relayout_slots.append((holder, attr, w))
                self.relayout_layouts.append("packed")
                holder, attr = rows, "weight"
            if transposed:
                self.relayout_slots.append((holder, attr, w))
                self.relayout_layouts.append("transposed")

    # --- weights stored transposed (or packed) --------------------------------------------------------------
    # The model's parameters (and the fused buffers they are views of) stay as the wire lays them, so that an
    # update lands in them with no copy (spare_weights.py). Where multiplying by a weight is faster with it
    # stored transposed (`LinearKernels.transposed`) or packed (`LinearKernels.packed`, packed.py), the runner
    # multiplies by such a copy instead: one per relayout slot, in the slot's layout (`relayout_layouts`). While
    # sequences decode, the engine builds the copies of an update's weights from the received tensors before
    # it switches to them (`copy_plans`, each filled as its weight arrives) and takes them into use at the
    # switch (`use_copies`), so decoding never multiplies by a stale copy nor slows down on the live weights.
    # An update that arrives while nothing decodes switches at once: the live weights are used (`use_copies`
    # with the live weights themselves) until the copies built after the switch (`build_copies`) are ready.

    def transposed_weights(self) -> list[torch.Tensor]:
        """Copies of the live weights of every relayout slot in its layout (freshly allocated)."""
        return [relayout_copy(layout, live) for (_, _, live), layout in zip(self.relayout_slots, self.relayout_layouts)]

    def use_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Multiply by these, one per relayout slot, from the next step on (what it replaces is not kept for
        `build_copies`: it may be a live weight). Between steps only."""
        for slot, ((holder, attr, _), w) in enumerate(zip(self.relayout_slots, weights)):
            setattr(holder, attr, self._multiplied(slot, w))
        self._retired.clear()
        self._foreign.clear()

    def _multiplied(self, slot: int, weight: torch.Tensor) -> torch.Tensor:
        """What the runner multiplies by for a slot holding `weight` (a copy in the slot's layout, or the live
        weight): a packed copy as oneDNN's view of it."""
        if weight is self.relayout_slots[slot][2] or self.relayout_layouts[slot] != "packed":
            return weight
        layout, rows = self._packed_layouts[slot]
        return layout.view(weight, rows)

    def build_copies(self, sources: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Copies of `sources` (relayout slot -> the weight that slot will hold) in their slots' layouts, written
        into the copies that the last `use_copies` retired, so steady updates allocate nothing. Reads only
        `sources` and retired copies: safe while decoding, but not concurrently with `use_copies`."""
        copies = {}
        for slot, (copy, fill) in self.copy_plans(sources).items():
            fill()
            copies[slot] = copy
        return copies

    def copy_plans(self, sources: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, Callable[[], None]]]:
        """`build_copies` in two halves, per slot: (the copy, a function that fills it from the source as it is
        when called): for sources whose values have not arrived yet (`relayout_copier`)."""
        return {slot: relayout_copier(self.relayout_layouts[slot], src, out=self._retired.pop(slot, None))
                for slot, src in sources.items()}

    def use_copies(self, copies: dict[int, torch.Tensor], foreign: bool = False) -> None:
        """Multiply by these (relayout slot -> transposed copy, or the slot's live weight itself) from the next
        step on; the copies they replace are kept for `build_copies` to write the next ones into, except
        `foreign` ones: copies another process made, in memory it will write again. Between steps only."""
        for slot, copy in copies.items():
            holder, attr, live = self.relayout_slots[slot]
            old = getattr(holder, attr)
            if old is not live and id(old) not in self._foreign:  # a copy of ours, not the live weight
                self._retired[slot] = old.panels if old.is_mkldnn else old
            self._foreign.discard(id(old))
            new = self._multiplied(slot, copy)
            if foreign:
                self._foreign.add(id(new))
            setattr(holder, attr, new)

    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, [max_len, head_dim], from the model's rotary module (the same
        values it computes per call); sin carries rotate_half's sign, so that
        rotate(x) = x * cos + roll(x, head_dim / 2) * sin."""
        with torch.no_grad():
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            positions = torch.arange(self.max_len, device=self.device)[None]
            cos, sin = self.inner.rotary_emb(dummy, positions)
        cos, sin = cos[0].clone(), sin[0].clone()
        half = self.head_dim // 2
        sin[:, :half] = -sin[:, :half]
        return cos, sin

    def _fused_rope_table(self) -> torch.Tensor | None:
        """cos and sin of every position for every head of the fused q/k/v output, [max_len, 2, heads, d],
        when that fits in ROPE_TABLE_BYTES (else a decode step builds its rows in `_step_rope`). v heads get
        cos 1, sin 0, the identity: q, k and v go through the rotation together and v comes out unchanged."""
        heads = self.num_heads + 2 * self.num_kv_heads
        shape = (self.max_len, 2, heads, self.head_dim)
        if self._rope.element_size() * shape[0] * shape[1] * shape[2] * shape[3] > ROPE_TABLE_BYTES:
            return None
        table = torch.zeros(shape, dtype=self.dtype, device=self.device)
        table[:, 0] = 1.0
        table[:, :, :self.num_heads + self.num_kv_heads] = self._rope[:, :, None]
        return table

    def _init_kv_cache(self, keys_transposed: bool) -> None:
        """One flat KV cache tensor per layer (`_kv_flat`); `keys[layer]` and `values[layer]` are views of it,
        [slots, kv_heads, max_len, head_dim]. With `keys_transposed` the keys are stored as
        [..., head_dim, max_len], so that on CPU the attention scores are a plain matmul of the queries with
        the stored keys, faster than against keys stored position by position. Either way
        (slot, kv head) merge into one batch dimension for the attention's batched matmuls without a copy,
        and a decode step writes every token's k and v of a layer with one `put_` at precomputed offsets."""
        slots, kv, length, d = self.num_slots, self.num_kv_heads, self.max_len, self.head_dim
        n = slots * kv * length * d
        self._kv_flat = [torch.zeros(2 * n, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.keys, self.values, self._keys_t_heads, self._v_heads = [], [], [], []
        for flat in self._kv_flat:
            keys = flat[:n].view(slots, kv, d, length).transpose(2, 3) if keys_transposed \
                else flat[:n].view(slots, kv, length, d)
            self.keys.append(keys)
            self.values.append(flat[n:].view(slots, kv, length, d))
            self._keys_t_heads.append(self.keys[-1].transpose(2, 3).reshape(slots * kv, d, length))  # a view
            self._v_heads.append(self.values[-1].view(slots * kv, length, d))
        # Offset in `_kv_flat` of (slot, k/v, kv head, dim j) at position 0, [slots, 2, kv, d], and how far one
        # position moves each of k and v, [1, 2, 1, 1]: a step's write offsets are two ops for all layers.
        ks, vs = self.keys[0].stride(), self.values[0].stride()
        index = [torch.arange(size, device=self.device) for size in (slots, kv, d)]
        def offsets(stride: tuple[int, ...], start: int) -> torch.Tensor:
            return start + index[0][:, None, None] * stride[0] + index[1][None, :, None] * stride[1] \
                + index[2][None, None, :] * stride[3]
        self._write_base = torch.stack((offsets(ks, 0), offsets(vs, n)), 1)
        self._write_step = torch.tensor([ks[2], vs[2]], device=self.device).view(1, 2, 1, 1)

    # --- slots ---------------------------------------------------------------------------------------------

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length].copy_(cache[src, :, :length])

    # --- the layers ----------------------------------------------------------------------------------------

    def _norm(self, norm: _Norm, x: torch.Tensor) -> torch.Tensor:
        if self.dtype != torch.float32:  # the model's own norm: it computes in float32 and casts back
            return norm.module(x)
        if self.device.type != "cpu":
            return F.rms_norm(x, norm.shape, norm.weight, norm.eps)
        # x * rsqrt(mean(x^2) + eps) * w in five ops: on CPU F.rms_norm runs as about ten, slower at decode sizes,
        # where the norms are a visible share of a tiny model's whole decode step
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.mul(x, torch.addcmul(norm.eps_t, r, r, value=1 / norm.shape[0]).rsqrt_()).mul_(norm.weight)

    def _rotate_qk(self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k of qkv [..., heads, head_dim], normalised (Qwen3) and rotated together."""
        qk = qkv[..., :self.num_heads + self.num_kv_heads, :]
        if layer.q_norm is not None:
            qk = self._norm_qk(layer, qk)
        return qk * cos + qk.roll(self.head_dim // 2, -1) * sin

    def _norm_qk(self, layer: _Layer, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head norms of q and k, qk [..., q heads + kv heads, head_dim]."""
        h = self.num_heads
        return torch.cat((layer.q_norm(qk[..., :h, :]), layer.k_norm(qk[..., h:, :])), dim=-2)

    def _linear_add(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ w.T (+ b), added in place into the matmul's fresh output (no slower than addmm
        or oneDNN's fused add post-op at decode sizes)."""
        return self.linear(x, w, b).add_(residual)

    def _mlp_residual(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        x = self._norm(layer.post_norm, h)
        if layer.gate_up_w is None:
            return h + layer.mlp(x)
        gate_up = self.linear(x, layer.gate_up_w, layer.gate_up_b)
        inter = gate_up.shape[-1] // 2
        # one fused matmul then silu and product beat two matmuls with oneDNN's fused silu/multiply post-ops
        act = torch.mul(F.silu(gate_up[:, :inter], inplace=True), gate_up[:, inter:])
        return self._linear_add(act, layer.down_w, layer.down_b, h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(self._norm(self._final_norm, h), self._head_w, self._head_b).float()

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Fill `slot`'s cache with the prompt; return the logits of the next token, [vocab]."""
        return self.prefill_batch([slot], [token_ids])[0]

    @torch.inference_mode()
    def prefill_batch(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Fill each slot's cache with its prompt (one padded forward per chunk of prompts); return the
        logits of each prompt's next token, [len(prompts), vocab]."""
        out, start = [], 0
        while start < len(prompts):
            end, longest = start + 1, len(prompts[start])
            while end < len(prompts):
                padded = max(longest, len(prompts[end])) * (end + 1 - start)
                if padded > PREFILL_CHUNK_TOKENS:
                    break
                longest = max(longest, len(prompts[end]))
                end += 1
            out.append(self._prefill_chunk(slots[start:end], prompts[start:end]))
            start = end
        return torch.cat(out)

    def _prefill_chunk(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        # Right padding: causal attention never lets a prompt token see the padding after it; the padded
        # positions' cache entries lie beyond the sequence's length, are never attended, and get overwritten.
        b, n = len(prompts), max(len(p) for p in prompts)
        h_, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        ids = torch.zeros(b, n, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        last = torch.tensor([i * n + len(p) - 1 for i, p in enumerate(prompts)], device=self.device)
        slot_ids = torch.tensor(list(slots), device=self.device)
        h = F.embedding(ids, self._embed_w).view(b * n, -1)
        cos, sin = self._cos[:n, None, :], self._sin[:n, None, :]
        for li, layer in enumerate(self.layers):
            qkv = self.linear(self._norm(layer.input_norm, h), layer.qkv_w, layer.qkv_b).view(b, n, -1, d)
            qk = self._rotate_qk(layer, qkv, cos, sin).transpose(1, 2)
            q, k, v = qk[:, :h_], qk[:, h_:], qkv[:, :, h_ + kv:].transpose(1, 2)
            self.keys[li][slot_ids, :, :n] = k
            self.values[li][slot_ids, :, :n] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.gqa)
            attn = attn.transpose(1, 2).reshape(b * n, h_ * d)
            if li == len(self.layers) - 1:  # only the last position of each prompt goes on to the logits
                attn, h = attn[last], h[last]
            h = self._linear_add(attn, layer.o_w, layer.o_b, h)
            h = self._mlp_residual(layer, h)
        return self._logits(h)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               span: tuple[int, int] | None = None) -> torch.Tensor:
        """One token for each of the B sequences in slots 0..B-1; `positions[i]` is where sequence i's token
        goes (its current length); `span`, when the caller knows it, is (min, max) of `positions`. Returns
        logits [B, vocab]."""
        b = token_ids.shape[0]
        lo, hi = span if span is not None else (int(positions.min()), int(positions.max()))
        upto = hi + 1
        h_, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(token_ids, self._embed_w)
        cos, sin = self._decode_rope(positions, b)
        mask = None if lo == hi else self._decode_mask(positions, upto)  # equal lengths: nothing to hide
        # where each sequence's new k and v go in every layer's `_kv_flat`, [b * 2 * kv * d]
        write_at = (self._write_base[:b] + positions[:, None, None, None] * self._write_step).view(-1)
        for li, layer in enumerate(self.layers):
            qkv = self.linear(self._norm(layer.input_norm, h), layer.qkv_w, layer.qkv_b).view(b, -1, d)
            if layer.q_norm is not None:
                qkv = torch.cat((self._norm_qk(layer, qkv[:, :h_ + kv]), qkv[:, h_ + kv:]), 1)
            qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, -1), sin)  # rotates q and k, leaves v as it is
            self._kv_flat[li].put_(write_at, qkv[:, h_:])  # k and v of the new tokens, [b, 2 * kv, d]
            attn = self._decode_attention(li, qkv[:, :h_], b, upto, mask)
            h = self._linear_add(attn, layer.o_w, layer.o_b, h)
            h = self._mlp_residual(layer, h)
        return self._logits(h)

    def _decode_rope(self, positions: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's cos and sin, [b, heads, d] over the fused q/k/v heads (identity on v: see
        `_fused_rope_table`)."""
        if self._rope_heads is not None:
            rope = self._rope_heads.index_select(0, positions)
            return rope[:, 0], rope[:, 1]
        rope, qk_heads = self._step_rope[:, :b], self.num_heads + self.num_kv_heads
        rope[:, :, :qk_heads] = self._rope.index_select(0, positions).transpose(0, 1)[:, :, None]
        return rope[0], rope[1]

    def _decode_mask(self, positions: torch.Tensor, upto: int) -> torch.Tensor:
        """Additive mask [b * kv_heads, 1, upto] hiding the keys beyond each sequence's position. On a
        non-CPU device, the boolean mask [b, 1, 1, upto] that scaled_dot_product_attention takes."""
        visible = torch.arange(upto, device=self.device)[None, :] <= positions[:, None]
        if not self.manual_attention:
            return visible[:, None, None, :]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        return bias.repeat_interleave(self.num_kv_heads, 0)[:, None, :]

    def _decode_attention(self, li: int, q: torch.Tensor, b: int, upto: int,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """q [b, heads, d] against the cached keys of slots 0..b-1 up to `upto`; returns [b, heads * d].
        The query heads that share a kv head attend as that head's queries: no repeated keys."""
        kv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv
        if not self.manual_attention:
            keys = self.keys[li][:b, :, :upto]
            values = self.values[li][:b, :, :upto]
            out = F.scaled_dot_product_attention(q.reshape(b, kv, group, d), keys, values, attn_mask=mask,
                                                 scale=self.scaling)
            return out.reshape(b, -1)
        # On CPU two batched matmuls beat scaled_dot_product_attention's kernel at decode shapes (one query
        # row per head group).
        q = q.reshape(b * kv, group, d)
        keys_t, values = self._keys_t_heads[li][:b * kv, :, :upto], self._v_heads[li][:b * kv, :upto]
        bias, beta = (self._no_bias, 0.0) if mask is None else (mask, 1.0)
        scores = torch.baddbmm(bias, q, keys_t, beta=beta, alpha=self.scaling)
        return torch.bmm(torch.softmax(scores, -1), values).view(b, -1)
