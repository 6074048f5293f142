"""The runner that does the embedded engine's forward passes with a per-sequence KV cache, chosen per model.

`SlotRunner` (slot_runner.py) is the fast path for the Llama family (Llama, Qwen2, Qwen3, Mistral without sliding
window): its own, leaner forward over the model's weights. `HFRunner` serves any other causal LM through the
model's own forward and a DynamicCache per sequence: one forward per sequence per step, slower, but correct for
every architecture transformers loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipelinerl.engines.embedded.slot_runner import SlotRunner

FAST_PATH_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def supports_fast_path(model: torch.nn.Module) -> bool:
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAST_PATH_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        return False
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return False
    rope_type = str(getattr(inner.rotary_emb, "rope_type", "default"))
    return "dynamic" not in rope_type and rope_type != "longrope"  # those depend on the sequence length


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

    def prefill_batch(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([self.prefill(s, list(p)) for s, p in zip(slots, prompts)])

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               span: tuple[int, int] | None = None) -> torch.Tensor:
        rows = []
        for i in range(token_ids.shape[0]):
            out = self.model(input_ids=token_ids[i:i + 1, None], past_key_values=self.caches[i], use_cache=True,
                             position_ids=positions[i:i + 1, None])
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)


def make_runner(model: torch.nn.Module, num_slots: int, max_len: int,
                transposed: str = "auto") -> SlotRunner | HFRunner:
    if supports_fast_path(model):
        return SlotRunner(model, num_slots, max_len, transposed=transposed)
    return HFRunner(model, num_slots, max_len)


def copy_slot(runner: SlotRunner | HFRunner, src: int, dst: int, length: int) -> None:
    """Duplicate a prefilled prompt's cache (the n samples of one prompt share their prefill)."""
    if isinstance(runner, HFRunner):
        runner.copy_slot(src, dst, length)
    else:
        runner.move_slot(src, dst, length)
