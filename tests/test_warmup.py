"""The supervised warm-up's batches cut by width (pipelinerl/models/warmup.py `by_width`): the same examples and
the same gradient as one padded batch, with less padding."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.models.warmup import _chunk_loss, by_width


def test_a_mixed_batch_is_cut_by_width_and_one_of_one_length_is_not():
    batch = [([1] * n, [2, 3]) for n in [10] * 8 + [148] * 4 + [38] * 4]  # sums, instructions, spellings
    chunks = by_width(batch)
    assert sorted(map(len, (p for c in chunks for p, _ in c))) == sorted(len(p) for p, _ in batch)
    padded = sum(len(c) * max(len(p) + len(t) for p, t in c) for c in chunks)
    assert padded < 0.5 * len(batch) * 150
    same = [([1] * n, [2]) for n in [9, 10, 11, 10] * 4]
    assert by_width(same) == [same]  # nothing to save: one batch, as it always was


def test_the_cut_batch_has_the_gradient_of_the_padded_one(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [("12+34=", "46"), ("spell 'cat' backward:", " tac"), ("Write about rain in quotes, no commas:", ' "rain"')]
    batch = [(tokenizer.encode(p), tokenizer.encode(t) + [tokenizer.eos_token_id]) for p, t in texts * 4]

    def gradient(chunks) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        targets = sum(len(t) for _, t in batch)
        for chunk in chunks:
            (_chunk_loss(model, tokenizer, chunk, torch.device("cpu")) * sum(len(t) for _, t in chunk)
             / targets).backward()
        return [p.grad.clone() for p in model.parameters()]

    chunks = by_width(batch)
    assert len(chunks) > 1
    for whole, cut in zip(gradient([batch]), gradient(chunks)):
        torch.testing.assert_close(cut, whole, rtol=1e-4, atol=1e-6)
