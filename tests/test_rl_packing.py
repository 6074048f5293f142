import random

import pytest
import torch

from pipelinerl.rl import (
    build_packed_batch,
    logprobs_from_logits,
    pack_sequences,
    packed_causal_mask,
    to_additive_mask,
)
from pipelinerl.trainer.forward import packed_logprobs

transformers = pytest.importorskip("transformers")

# --------------------------------------------------------------------------------------------- bin packing


def test_pack_sequences_ffd_by_hand():
    # lengths [5, 3, 8, 2, 6, 1], budget 10; visit 8(i2) 6(i4) 5(i0) 3(i1) 2(i3) 1(i5):
    # 8 -> bin0 (free 2); 6 -> bin1 (free 4); 5 -> bin2 (free 5); 3 -> bin1 (free 1);
    # 2 -> bin0 (free 0); 1 -> bin1 (free 0)
    assert pack_sequences([5, 3, 8, 2, 6, 1], 10) == [[2, 3], [4, 1, 5], [0]]
    assert pack_sequences([10, 10], 10) == [[0], [1]]
    assert pack_sequences([], 10) == []


def test_pack_sequences_properties_on_random_lengths():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
        bins = pack_sequences(lengths, 128)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
        # first-fit leaves at most one bin at most half full (its items would have fit in the earlier one)
        assert sum(sum(lengths[i] for i in b) <= 64 for b in bins) <= 1


def test_pack_sequences_errors_name_the_sample():
    with pytest.raises(ValueError, match="sample 2 is empty"):
        pack_sequences([3, 4, 0], 10)
    with pytest.raises(ValueError, match="sample 1 has length 11"):
        pack_sequences([3, 11], 10)
    with pytest.raises(ValueError):
        pack_sequences([3], 0)


# --------------------------------------------------------------------------------------------- packed batch


def test_build_packed_batch_by_hand():
    batch = build_packed_batch(
        [[5, 6, 7], [8], [9, 10]],
        token_fields={
            "adv": [[0.5, 0.5, 0.5], [1.0], [-1, -1]],
            "mask": [[False, True, True], [True], [False, True]],
        },
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch.seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.label_mask.tolist() == [False, True, True, False, False, True]
    assert batch.num_sequences == 3 and batch.max_seqlen == 3
    assert batch.fields["adv"].dtype == torch.float32
    assert batch.fields["adv"].tolist() == [0.5, 0.5, 0.5, 1.0, -1.0, -1.0]
    assert batch.fields["mask"].dtype == torch.bool


def test_build_packed_batch_errors():
    with pytest.raises(ValueError, match="sample 1 is empty"):
        build_packed_batch([[1, 2], []])
    with pytest.raises(ValueError, match="sample 0"):
        build_packed_batch([[1, 2]], token_fields={"adv": [[1.0]]})


def test_packed_causal_mask_by_hand():
    m = packed_causal_mask(torch.tensor([0, 0, 1, 1, 1]))
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert m.shape == (1, 1, 5, 5) and m.dtype == torch.bool
    assert torch.equal(m[0, 0], expect)
    add = to_additive_mask(m, torch.float32)
    assert (add[m] == 0).all() and (add[~m] == torch.finfo(torch.float32).min).all()


# --------------------------------------------------------------------------------------------- tiny model


def _tiny_qwen2(attn_implementation: str):
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).float().train()


SEQUENCES = [
    [3, 17, 22, 9, 41, 5, 60],
    [11, 2, 33],
    [7, 7, 50, 21, 19],
    [44, 1],
]

MODES = [
    ("sdpa", "mask"),
    ("eager", "mask"),
    ("sdpa", "position_ids"),
    ("eager", "position_ids"),
    ("sdpa", "auto"),
    ("sdpa", "padded"),
    ("eager", "padded"),
]


@pytest.fixture(scope="module")
def models():
    return {impl: _tiny_qwen2(impl) for impl in ("sdpa", "eager")}


def _weights(lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.rand(n, generator=g) for n in lengths]


@pytest.mark.parametrize("impl,attention", MODES)
def test_packed_loss_and_grads_equal_one_by_one(models, impl, attention):
    model = models[impl]
    weights = _weights([len(s) for s in SEQUENCES])

    # reference: each sequence alone, plain forward, losses summed
    model.zero_grad()
    ref_loss = torch.zeros(())
    ref_lps = []
    for seq, w in zip(SEQUENCES, weights, strict=True):
        ids = torch.tensor([seq])
        lp = logprobs_from_logits(model(ids, use_cache=False).logits[0, :-1], ids[0, 1:])
        ref_lps.append(torch.cat([lp.new_zeros(1), lp]))
        ref_loss = ref_loss - (w[1:] * lp).sum()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    batch = build_packed_batch(SEQUENCES, token_fields={"w": weights})
    lps = packed_logprobs(model, batch, attention=attention)
    assert lps.shape == (sum(len(s) for s in SEQUENCES),)
    assert (lps[~batch.label_mask] == 0).all()
    loss = -(batch.fields["w"] * lps).sum()
    loss.backward()

    torch.testing.assert_close(lps.detach(), torch.cat(ref_lps).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("impl,attention", MODES)
def test_no_attention_across_sequences(models, impl, attention):
    model = models[impl]
    changed = [list(s) for s in SEQUENCES]
    changed[0] = [(t + 13) % 64 for t in changed[0]]  # alter every token of sequence 0
    a, b = build_packed_batch(SEQUENCES), build_packed_batch(changed)
    with torch.no_grad():
        lp_a = packed_logprobs(model, a, attention=attention, temperature=0.8)
        lp_b = packed_logprobs(model, b, attention=attention, temperature=0.8)
    first = a.seq_ids == 0
    assert not torch.allclose(lp_a[first], lp_b[first])
    torch.testing.assert_close(lp_a[~first], lp_b[~first], atol=1e-6, rtol=0)


def test_packed_logprobs_rejects_unknown_mode(models):
    with pytest.raises(ValueError):
        packed_logprobs(models["sdpa"], build_packed_batch(SEQUENCES), attention="bogus")


def test_auto_attention_takes_padded_rows_only_where_they_cost_less():
    """Sequences of about one length: right-padded rows (attention N * L^2, little padding) beat one row under
    a dense mask (T^2). One long sequence among many short ones: the padding would dwarf the tokens."""
    from pipelinerl.rl.packing import padded_is_cheaper, padded_rows, resolve_attention

    config = transformers.Qwen2Config(hidden_size=512, intermediate_size=1408, num_attention_heads=4,
                                      num_key_value_heads=4)
    even = build_packed_batch([[1] * (150 + i % 10) for i in range(25)])  # the counting recipe's shape
    assert padded_is_cheaper(even, config)
    assert resolve_attention(even, "sdpa", "auto", config) == "padded"
    assert resolve_attention(even, "flash_attention_2", "auto", config) == "position_ids"
    assert resolve_attention(even, "sdpa", "mask", config) == "mask"  # an explicit choice is kept
    skewed = build_packed_batch([[1] * 2000] + [[1] * 20] * 50)
    assert not padded_is_cheaper(skewed, config)
    assert resolve_attention(skewed, "sdpa", "auto", config) == "mask"
    assert padded_is_cheaper(build_packed_batch([[1] * 3000]), config)  # one sequence: no padding at all

    rows, index = padded_rows(build_packed_batch(SEQUENCES))
    assert rows.shape == (4, 7)
    assert rows[1].tolist() == [11, 2, 33, 0, 0, 0, 0]  # right-padded
    assert rows.view(-1)[index].tolist() == [t for s in SEQUENCES for t in s]


# --------------------------------------------------------------------------------------------- shared prompts

# two groups (prompts [3, 17, 22] and [7, 50]) and a sequence of its own; the first group's third answer follows
# the lone sequence, so it opens a tree again
SHARED = [[3, 17, 22, 9, 41], [3, 17, 22, 5], [3, 17, 22, 60, 8, 2], [7, 50, 21], [7, 50, 19, 4], [11, 2, 33],
          [3, 17, 22, 44]]
SHARED_PROMPTS = [3, 3, 3, 2, 2, 2, 3]


def test_shared_prompt_batch_by_hand():
    batch = build_packed_batch([[5, 6, 7, 8], [5, 6, 9], [5, 1, 2]], prompt_lengths=[2, 2, 2],
                               token_fields={"m": [[False, False, True, True], [False, False, True],
                                                   [False, False, True]]})
    # the second sequence shares [5, 6]; the third's prompt [5, 1] differs: a tree of its own
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 5, 1, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert batch.seq_ids.tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    assert batch.tree_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert batch.shared.tolist() == [True, True, False, False, False, False, False, False]
    assert batch.prev_index.tolist() == [-1, 0, 1, 2, 1, 4, 5, 6]  # token 9 comes after the prompt's 6
    assert batch.lengths == [4, 1, 3] and batch.cu_seqlens.tolist() == [0, 4, 5, 8]
    assert batch.fields["m"].tolist() == [False, False, True, True, True, False, False, True]
    mask = packed_causal_mask(batch.seq_ids, batch.tree_ids, batch.shared)[0, 0]
    assert mask[4].tolist() == [True, True, False, False, True, False, False, False]  # 9 sees the prompt only
    assert mask[3].tolist() == [True, True, True, True, False, False, False, False]
    assert mask[7].tolist() == [False] * 5 + [True] * 3
    with pytest.raises(ValueError, match="sample 1: prompt length 5"):
        build_packed_batch([[1, 2], [1, 2, 3]], prompt_lengths=[1, 5])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(models, impl):
    """The same log-probs, entropies and gradients as every sequence packed whole, from fewer tokens; a changed
    answer changes nothing of its group's other answers (they do not see each other)."""
    from pipelinerl.trainer.forward import packed_logprobs_and_entropy

    model = models[impl]
    weights = [torch.tensor([0.0] * p + [1.0 + 0.1 * j for j in range(len(s) - p)])
               for s, p in zip(SHARED, SHARED_PROMPTS, strict=True)]

    def run(batch):
        model.zero_grad()
        lps, entropy = packed_logprobs_and_entropy(model, batch, temperature=0.9)
        (batch.fields["w"] * lps).sum().backward()
        answers = batch.fields["w"] > 0
        per_seq = [(lps[answers & (batch.seq_ids == i)].detach(), entropy[answers & (batch.seq_ids == i)])
                   for i in range(len(SHARED))]
        return per_seq, {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, whole_grads = run(build_packed_batch(SHARED, {"w": weights}))
    shared_batch = build_packed_batch(SHARED, {"w": weights}, prompt_lengths=SHARED_PROMPTS)
    assert shared_batch.input_ids.shape[1] == sum(map(len, SHARED)) - 3 - 3 - 2  # three prompts not repeated
    shared, shared_grads = run(shared_batch)
    for (lp_a, h_a), (lp_b, h_b) in zip(whole, shared, strict=True):
        torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h_b, h_a, atol=1e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)

    changed = [list(s) for s in SHARED]
    changed[0][3:] = [(t + 13) % 64 for t in changed[0][3:]]
    with torch.no_grad():
        a = packed_logprobs(model, shared_batch)
        b = packed_logprobs(model, build_packed_batch(changed, prompt_lengths=SHARED_PROMPTS))
    own = shared_batch.seq_ids == 0
    assert not torch.allclose(a[own], b[own])
    torch.testing.assert_close(a[~own], b[~own], atol=1e-6, rtol=0)


def test_shared_prompts_only_where_they_cost_less_and_only_under_a_mask(models):
    from pipelinerl.rl.packing import shared_prompts_are_cheaper

    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=4)
    # the tiny recipe: 8 groups of 8 answers of ~4 tokens to a 6-token prompt
    assert shared_prompts_are_cheaper([10] * 64, 8 * 6 + 64 * 4, config)
    # long answers to a short prompt: the dense mask over 4,000 tokens costs more than 7 prompts saved
    assert not shared_prompts_are_cheaper([20 + 480] * 8, 20 + 8 * 480, config)
    assert not shared_prompts_are_cheaper([10, 10], 20, config)  # nothing shared
    batch = build_packed_batch(SHARED, prompt_lengths=SHARED_PROMPTS)
    for attention in ("padded", "position_ids"):
        with pytest.raises(ValueError, match="shared prompts"):
            packed_logprobs(models["sdpa"], batch, attention=attention)
