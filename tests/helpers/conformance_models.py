"""Causal LMs that are hard for the conformance suite: each would make a suite that relies on how a typical model
behaves fail a correct engine. Tiny (hidden 32, 1-2 layers), built in well under a second, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelinerl.models.tiny import build_char_tokenizer, build_tiny_model


def build_fresh_tied_model(out_dir: str | Path) -> Path:
    """Qwen2 as `from_config` makes it (initializer range 0.02) with tied embeddings: the residual stream is
    dominated by the current token's embedding, which is also its output row, so it repeats its input's last
    token, and a random perturbation of its weights leaves that greedy output unchanged."""
    return build_tiny_model(out_dir, hidden_size=32, num_layers=2, seed=3, tie_embeddings=True)


def build_confident_model(out_dir: str | Path, sharpness: float = 60.0) -> Path:
    """A model whose next-token distribution is near one-hot everywhere (as a warmed-up model's is on its
    task): a randomly initialised tied model whose final norm is scaled by `sharpness`, which scales every
    logit (the tied head cannot be scaled without scaling the input embeddings too)."""
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(out_dir, hidden_size=32, num_layers=2, initializer_range=0.2, seed=5, tie_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpness)
    model.save_pretrained(out)
    return out


def build_one_token_model(out_dir: str | Path, token: str = "q", margin: float = 50.0) -> Path:
    """A model (untied head) that writes `token` whatever the input, by `margin` in logits: every input embedding
    is the same vector, so every position's hidden state is the same whatever the tokens (attention averages
    identical values), and the head's row for `token` is set to win on that hidden state."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    out = build_tiny_model(out_dir, hidden_size=32, num_layers=1, initializer_range=0.2, seed=7,
                           tie_embeddings=False, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    target = tokenizer.convert_tokens_to_ids(token)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(emb[target].expand_as(emb))
        hidden = model.model(torch.tensor([[target, target + 1]])).last_hidden_state[0]
        assert torch.allclose(hidden[0], hidden[1], atol=1e-5), "the hidden state should not depend on the input"
        head = model.get_output_embeddings().weight
        logits = head @ hidden[0]
        others = torch.cat([logits[:target], logits[target + 1:]])
        head[target] += (float(others.max() - logits[target]) + margin) * hidden[0] / hidden[0].dot(hidden[0])
    model.save_pretrained(out)
    return out
