import random

import pytest
import torch

from pipelinerl.rl import (
    build_packed_batch,
    logprobs_from_logits,
    pack_sequences,
    packed_causal_mask,
    packed_logprobs,
    to_additive_mask,
)

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
