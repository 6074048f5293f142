"""Forward passes with a per-sequence KV cache, for continuous batching.

`SlotRunner` is the fast path for the Llama family (Llama, Qwen2, Qwen3, Mistral without sliding window):
it reuses the Hugging Face model's own modules (projections, norms, MLP, rotary embedding) and replaces only
the attention's cache handling. The KV cache is one tensor per layer, [slots, kv_heads, max_len, head_dim];
running sequences occupy slots 0..B-1 contiguously (a finished sequence's slot is refilled by moving the last
one), so a decode step attends over a view of the cache, not a gathered copy.

`HFRunner` serves any other causal LM through the model's own forward and a DynamicCache per sequence: one
forward per sequence per step, slower, but correct for every architecture transformers loads.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

FAST_PATH_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def supports_fast_path(model: torch.nn.Module) -> bool:
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAST_PATH_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb"))


class SlotRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int):
        self.model = model
        self.inner = model.model
        cfg = model.config
        attn0 = self.inner.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn0.scaling
        self.rotary = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        self.num_slots, self.max_len = num_slots, max_len
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        shape = (num_slots, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.inner.layers]
        self.device = device

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst, :, :length].copy_(k[src, :, :length])
            v[dst, :, :length].copy_(v[src, :, :length])

    def _attention_block(self, layer: torch.nn.Module, li: int, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, write: tuple, keys_upto: int, slots: slice | torch.Tensor,
                         mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        attn = layer.self_attn
        b, q_len, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, q_len, -1, self.head_dim)
        k = attn.k_proj(x).view(b, q_len, -1, self.head_dim)
        v = attn.v_proj(x).view(b, q_len, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kc, vc = self.k_cache[li], self.v_cache[li]
        write(kc, k)
        write(vc, v)
        keys, values = kc[slots, :, :keys_upto], vc[slots, :, :keys_upto]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal,
                                             scale=self.scaling, enable_gqa=self.num_kv_heads != self.num_heads)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        return h + out

    def _finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(h)).float()

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Fill `slot`'s cache with the prompt; return the logits of the next token, [vocab]."""
        n = len(token_ids)
        ids = torch.tensor([token_ids], device=self.device)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, torch.arange(n, device=self.device)[None])

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[slot, :, :n].copy_(new[0])

        for li, layer in enumerate(self.inner.layers):
            h = self._attention_block(layer, li, h, cos, sin, write, n, slice(slot, slot + 1), None, True)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._finish(h[:, -1])[0]

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of the B sequences in slots 0..B-1; `positions[i]` is where sequence i's token
        goes (its current length). Returns logits [B, vocab]."""
        b = token_ids.shape[0]
        h = self.inner.embed_tokens(token_ids[:, None])
        cos, sin = self.inner.rotary_emb(h, positions[:, None])
        upto = int(positions.max()) + 1
        mask = (torch.arange(upto, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        rows = torch.arange(b, device=self.device)

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[rows, :, positions] = new[:, :, 0]

        for li, layer in enumerate(self.inner.layers):
            h = self._attention_block(layer, li, h, cos, sin, write, upto, slice(0, b), mask, False)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._finish(h[:, 0])


class HFRunner:
    """Any causal LM: the model's own forward, a DynamicCache per slot, one forward per sequence per step."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int):
        from transformers import DynamicCache

        self.model, self.num_slots, self.max_len = model, num_slots, max_len
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.caches: list = [None] * num_slots
        self.device = next(model.parameters()).device

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        import copy

        self.caches[dst] = copy.deepcopy(self.caches[src])

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        self.caches[slot] = self._new_cache()
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.caches[slot], use_cache=True)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = []
        for i in range(token_ids.shape[0]):
            out = self.model(input_ids=token_ids[i:i + 1, None], past_key_values=self.caches[i], use_cache=True,
                             position_ids=positions[i:i + 1, None])
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)


def make_runner(model: torch.nn.Module, num_slots: int, max_len: int) -> SlotRunner | HFRunner:
    if supports_fast_path(model):
        return SlotRunner(model, num_slots, max_len)
    return HFRunner(model, num_slots, max_len)


def copy_slot(runner: SlotRunner | HFRunner, src: int, dst: int, length: int) -> None:
    """Duplicate a prefilled prompt's cache (the n samples of one prompt share their prefill)."""
    if isinstance(runner, HFRunner):
        runner.copy_slot(src, dst, length)
    else:
        runner.move_slot(src, dst, length)
