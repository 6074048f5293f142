"""The trainer's linear layers through oneDNN (pipelinerl/trainer/linear_kernels.py): the same outputs and
gradients as torch's own `F.linear`, the same training steps, the choice made once per process, and never on a
sharded or non-float32 model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_trainer import step_with_grads  # the gradients an optimizer step saw
from torch import nn
from transformers import AutoModelForCausalLM

from pipelinerl.config import ConfigError, TrainerConfig
from pipelinerl.models.onednn import onednn_works
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.rl.packing import build_packed_batch
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer
from pipelinerl.trainer import linear_kernels as lk
from pipelinerl.trainer.forward import ChunkedHeadLogprobs, packed_logprobs, packed_logprobs_and_entropy

pytestmark = pytest.mark.skipif(not onednn_works(torch.device("cpu"), torch.float32),
                                reason="this torch has no working oneDNN")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lk_model"), hidden_size=64, num_layers=2, seed=3,
                            initializer_range=0.1)


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_f_linear_forward_and_backward(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 48, requires_grad=True)
    w = torch.randn(40, 48, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    # a gradient that arrives as a transposed (non-contiguous) view, as from a later transpose in a model
    upstream = torch.randn(40, 7, 3).permute(2, 1, 0)

    y = lk.OneDNNLinear.apply(x, w, b)
    assert type(y.grad_fn).__name__ == "OneDNNLinearBackward"  # really through the custom function
    (y * upstream).sum().backward()
    got = [y.detach(), x.grad, w.grad] + ([b.grad] if bias else [])

    # float64 reference
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y64 = F.linear(x64, w64, b64)
    (y64 * upstream.double()).sum().backward()
    want = [y64.detach(), x64.grad, w64.grad] + ([b64.grad] if bias else [])
    for g, r in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == r.shape
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-4)


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(8, 16)
    y = lk.OneDNNLinear.apply(x, w, None)
    y.sum().backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 16))


def _logprob_grads(model, seqs):
    model.zero_grad()
    lp = packed_logprobs(model, build_packed_batch(seqs))
    (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_routed_model_gives_the_same_logprobs_and_gradients(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    seqs = [[1, 5, 9, 13, 2], [1, 7, 7, 30, 31, 32, 2], [1, 4]]
    lp, grads = _logprob_grads(model, seqs)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    shapes = lk.choose_shapes(model, "onednn")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert shapes == {tuple(m.weight.shape) for m in linears}
    assert lk.route_linears(model, shapes) == len(linears)  # every projection and the (tied) head
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj(torch.randn(2, 64, requires_grad=True)).grad_fn).__name__ == "OneDNNLinearBackward"

    lp2, grads2 = _logprob_grads(model, seqs)
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-5)
    assert grads2.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert model.state_dict().keys() == state.keys()  # nothing added to what checkpoints save

    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision: autocast's path, in its dtype
        out = q_proj(torch.randn(2, 64))
    assert out.dtype == torch.bfloat16 and "OneDNN" not in type(out.grad_fn).__name__

    moved = nn.Linear(64, 8)  # a routed model moved off the CPU (to a GPU, by accelerate): torch's path
    assert lk.route_linears(moved, {(8, 64)}) == 1
    moved.to("meta")
    assert "forward" in moved.__dict__ and moved(torch.empty(2, 64, device="meta")).shape == (2, 8)

    assert lk.unroute_linears(model) == len(linears)
    assert "OneDNN" not in type(q_proj(torch.randn(2, 64, requires_grad=True)).grad_fn).__name__


@pytest.mark.parametrize("bias, entropy_grad", [(True, True), (False, False)])
def test_the_chunked_head_on_onednn_gives_blas_values_and_gradients(bias, entropy_grad):
    torch.manual_seed(1)
    n, hidden_size, vocab, chunk = 23, 48, 300, 8  # three chunks, the last one short
    hidden, weight = torch.randn(n, hidden_size), torch.randn(vocab, hidden_size) / 7
    b = torch.randn(vocab) if bias else None
    targets = torch.randint(0, vocab, (n,))

    def run(onednn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        bb = b.clone().requires_grad_() if bias else None
        lp, ent = ChunkedHeadLogprobs.apply(h, w, bb, targets, 0.8, chunk, torch.float32, True, entropy_grad, onednn)
        (lp * torch.linspace(0.5, 1.5, n)).sum().add((ent * 0.3).sum() if entropy_grad else 0).backward()
        return [lp.detach(), ent.detach(), h.grad, w.grad] + ([bb.grad] if bias else [])

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_routed_head_multiplies_its_chunks_on_onednn(model_dir, monkeypatch):
    """The chunked LM head multiplies the head's weight itself (no module call): it follows the layer's routing,
    forward and backward, and stays on BLAS where the head was not routed."""
    calls = []
    real = lk.onednn_linear
    monkeypatch.setattr(lk, "onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    head = model.get_output_embeddings()
    batch = build_packed_batch([[1, 5, 9, 13, 2], [1, 7, 7, 30, 31, 32, 2], [1, 4]])

    def grads(chunk):
        model.zero_grad()
        lp, _ = packed_logprobs_and_entropy(model, batch, chunk_tokens=chunk, temperature=0.9)
        lp.sum().backward()
        return lp.detach(), head.weight.grad.clone()

    want = grads(4)
    assert calls == []
    assert lk.route_linears(model, {tuple(head.weight.shape)}) >= 1 and lk.is_routed(head)
    got = grads(4)
    # only the head's shape is routed: 11 scored tokens in chunks of 4 make 3 logits products, 2 recomputed in the
    # backward (the first chunk's are kept), and per chunk one hidden and one weight gradient
    assert len(calls) == 3 + 2 + 3 + 3, calls
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    lk.unroute_linears(model)


def test_choices_by_setting_and_what_is_never_routed(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert lk.choose_shapes(model, "blas") == set()
    with pytest.raises(ValueError, match="trainer.linear_kernel"):
        lk.choose_shapes(model, "mkl")
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert lk.choose_shapes(bf16, "onednn") == set() and lk.route_linears(bf16, {(64, 64)}) == 0
    shard = nn.Linear(4, 4)
    shard.weight = nn.Parameter(torch.empty(0))  # what ZeRO-3 leaves in a module between gathers
    assert not lk.routable(shard)


def test_auto_takes_onednn_only_where_it_was_timed_faster_and_decides_once(model_dir, monkeypatch):
    timings = {(64, 64): (1.0, 0.5), (256, 64): (1.0, 0.9), (64, 256): (1.0, 0.79)}
    monkeypatch.setattr(lk, "AUTO_MIN_ELEMENTS", 64 * 64)
    calls = []

    def fake_time(out_f, in_f, repeats=3):
        calls.append((out_f, in_f))
        return timings.get((out_f, in_f), (1.0, 2.0))

    monkeypatch.setattr(lk, "time_shape", fake_time)
    monkeypatch.setattr(lk, "_decisions", {})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    chosen = lk.choose_shapes(model, "auto")
    assert chosen == {(64, 64), (64, 256)}  # 0.9 of BLAS's time is within noise: stays BLAS
    timed = list(calls)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    small = {(o, i) for o, i in shapes if o * i < 64 * 64}
    assert small and len(timed) == len(set(timed)) and set(timed) == shapes - small  # small ones: BLAS, untimed
    assert lk.choose_shapes(model, "auto") == chosen and calls == timed  # the second model: no new timing


def test_auto_on_this_machine_is_a_stable_subset(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    first = lk.choose_shapes(model, "auto")
    assert first <= shapes and lk.choose_shapes(model, "auto") == first


def _batch(i):
    def s(group, prompt, output, reward):
        return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                      behav_logprobs=[-4.0] * len(output), versions=[0] * len(output), finish_reason="stop",
                      reward=reward)
    return [s("a", [5, 6, 7 + i], [10, 11, 12], 1.0), s("a", [5, 6, 7 + i], [20, 21], 0.0),
            s("b", [8, 9], [30, 31 + i], 0.2), s("b", [8, 9], [40], 0.7)]


def test_a_trainer_through_onednn_steps_as_one_through_blas(model_dir, monkeypatch):
    calls = {"onednn": 0}
    real = lk.onednn_linear

    def counted(*args, **kwargs):
        calls["onednn"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(lk, "onednn_linear", counted)  # what the routed layers call, forward and backward
    cfg = dict(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, kl_coef=0.05)
    blas = Trainer(str(model_dir), TrainerConfig(linear_kernel="blas", **cfg), seed=1)
    onednn = Trainer(str(model_dir), TrainerConfig(linear_kernel="onednn", **cfg), seed=1)
    assert blas.onednn_shapes == set() and len(onednn.onednn_shapes) >= 4
    for trainer, routed in ((blas, False), (onednn, True)):
        for model in (trainer.unwrapped_model, trainer.ref_model):
            proj = model.model.layers[1].mlp.down_proj
            assert ("forward" in proj.__dict__) == routed
    for i in range(3):
        before = calls["onednn"]
        a, grads_a = step_with_grads(blas, _batch(i))
        assert calls["onednn"] == before  # nothing of the BLAS trainer's goes through oneDNN
        b, grads_b = step_with_grads(onednn, _batch(i))
        assert calls["onednn"] > before  # the routed layers' products really ran on oneDNN
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (i, key)
        if i > 0:  # Adam's update of a near-zero gradient amplifies last-bit differences to the learning rate
            continue
        for name, g in grads_a.items():  # the gradients the first update saw (bit for bit on some CPUs: a Xeon)
            torch.testing.assert_close(grads_b[name], g, rtol=1e-3, atol=1e-6, msg=name)
    blas.close()
    onednn.close()


def test_a_bad_setting_names_the_key():
    with pytest.raises(ConfigError, match="trainer.linear_kernel"):
        TrainerConfig(linear_kernel="mkl")
