"""Log-probs and entropy through a chunked LM head (`pipelinerl.trainer.forward.ChunkedHeadLogprobs`): the same values
and gradients as full [tokens, vocab] logits, at a fraction of the memory, with tied embeddings and the ways the
trainer calls a model; and what reaches the model's forward for each attention implementation.

Memory is the kernel's peak resident set size (VmHWM, reset before each measurement) on CPU.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipelinerl.rl.losses import entropy_from_logits, logprobs_from_logits
from pipelinerl.rl.packing import build_packed_batch, packed_forward_kwargs
from pipelinerl.trainer.forward import (
    ChunkedHeadLogprobs,
    packed_logprobs,
    packed_logprobs_and_entropy,
    resolve_attn_implementation,
)

transformers = pytest.importorskip("transformers")

QWEN_VOCAB = 152064  # Qwen2.5 7B / 32B
HIDDEN = 16  # the memory test's hidden size: small, so that the vocabulary-wide work is what it measures


def naive_head(hidden, weight, targets, temperature):
    """What the trainer computed before chunking: full logits, then float32 log-softmax and entropy."""
    logits = hidden @ weight.t()
    return (logprobs_from_logits(logits, targets, temperature),
            entropy_from_logits(logits.detach().float() / temperature))


def head_inputs(tokens: int, hidden_size: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.3  # logits of a few units: peaked, not one-hot
    targets = torch.randint(vocab, (tokens,), generator=g)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


# ------------------------------------------------------------------------------------------ the head alone


def test_chunked_head_equals_full_logits_at_qwen_vocab():
    """512 tokens x 152064 vocab: log-probs, entropy and the gradients w.r.t. hidden states and the head weight
    agree with full logits to float32 rounding, for a chunk size that does not divide the tokens."""
    hidden, weight, targets = head_inputs(512, 32, QWEN_VOCAB)
    upstream = torch.randn(512, generator=torch.Generator().manual_seed(1))
    want_lp, want_ent = naive_head(hidden, weight, targets, 0.7)
    (want_lp * upstream).sum().backward()
    want_gh, want_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = ChunkedHeadLogprobs.apply(hidden, weight, None, targets, 0.7, 200, torch.float32, True)
    assert not ent.requires_grad and lp.dtype == ent.dtype == torch.float32
    (lp * upstream).sum().backward()
    torch.testing.assert_close(lp, want_lp, atol=2e-5, rtol=1e-5)
    # sums over 152064 float32 terms, in another order: within a few float32 epsilons of a ~6 nat entropy
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=5e-5)
    torch.testing.assert_close(hidden.grad, want_gh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad, want_gw, atol=1e-6, rtol=1e-4)
    assert want_ent.min() > 0.5 and (want_lp.max() - want_lp.min()) > 5, "a degenerate distribution tests little"


def test_chunked_head_bias_temperature_and_lower_precision():
    """A head with a bias; and bfloat16 weights, where the matmuls run in bfloat16 and the softmax in float32 as
    under autocast before (gradient in the weights' dtype)."""
    hidden, weight, targets = head_inputs(64, 16, 1000, seed=2)
    bias = torch.randn(1000, generator=torch.Generator().manual_seed(3)).requires_grad_()
    logits = torch.nn.functional.linear(hidden, weight, bias)
    want = logprobs_from_logits(logits, targets, 1.3)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    lp, ent = ChunkedHeadLogprobs.apply(hidden, weight, bias, targets, 1.3, 7, torch.float32, False)
    assert ent.numel() == 0
    lp.sum().backward()
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
    for got, expected in zip((hidden.grad, weight.grad, bias.grad), want_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    want16 = logprobs_from_logits(h16 @ w16.t(), targets)
    want16.sum().backward()
    want_g16 = w16.grad.clone()
    w16.grad = None
    lp16, _ = ChunkedHeadLogprobs.apply(h16, w16, None, targets, 1.0, 16, torch.bfloat16, False)
    lp16.sum().backward()
    assert lp16.dtype == torch.float32 and w16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp16, want16, atol=1e-5, rtol=1e-5)  # same bfloat16 logits, same float32 softmax
    torch.testing.assert_close(w16.grad.float(), want_g16.float(), atol=2e-2, rtol=2e-2)  # summed per chunk


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def peak_rss_increase(variant: str, tokens: int, chunk: int = 0) -> tuple[float, float]:
    """(bytes, seconds): how far the peak RSS of one forward + backward rose above the RSS just before it.

    The peak is the kernel's high-water mark (VmHWM), reset right before (`clear_refs` 5, Linux >= 4.0), so
    earlier tests' peaks do not count; [tokens, vocab]-sized buffers are mmapped by the allocator, so they
    show in the RSS while they live and leave it when freed."""
    hidden, weight, targets = head_inputs(tokens, HIDDEN, QWEN_VOCAB)
    upstream = torch.randn(tokens)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if variant == "chunked":
        lp, _ = ChunkedHeadLogprobs.apply(hidden, weight, None, targets, 1.0, chunk, torch.float32, True)
    else:
        lp, _ = naive_head(hidden, weight, targets, 1.0)
    (lp * upstream).sum().backward()
    seconds = time.perf_counter() - start
    return (_status_kib("VmHWM") - before) * 1024, seconds


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures peak RSS through Linux /proc")
@pytest.mark.parametrize("tokens", [1024, pytest.param(8192, marks=pytest.mark.slow)])
def test_chunked_head_memory_at_qwen_vocab(tokens):
    """Forward + backward over 8192 tokens with the 152064 vocabulary: the [tokens, vocab] float32 logits alone
    would be 4.98 GB (and as much again for their gradient); the chunked head peaks below a quarter of that,
    at two [chunk, vocab] float32 buffers. (8192 tokens take 15-50 s of CPU here, so that size is marked slow;
    1024 tokens, 0.62 GB of logits, checks the same bounds in the default run.)

    The full-logits variant runs at 256 tokens only (8192 would need ~15 GB here), to show that the
    measurement does see [tokens, vocab] temporaries."""
    chunk = tokens // 16  # 512 at 8192 tokens
    full_logits_bytes = tokens * QWEN_VOCAB * 4
    chunked, seconds = peak_rss_increase("chunked", tokens, chunk)
    naive, _ = peak_rss_increase("naive", 256)
    print(f"chunked {tokens} tokens, chunk {chunk}: peak +{chunked / 1e6:.0f} MB in {seconds:.1f} s; "
          f"full logits at 256 tokens: +{naive / 1e6:.0f} MB; [T, V] float32 at {tokens} tokens: "
          f"{full_logits_bytes / 1e6:.0f} MB")
    assert naive > 2 * 256 * QWEN_VOCAB * 4, "the measurement misses [T, V] temporaries"
    assert chunked < full_logits_bytes / 4
    # the bound by construction: two [chunk, vocab] float32 buffers and the weight gradient, plus slack
    assert chunked < 2 * chunk * QWEN_VOCAB * 4 + QWEN_VOCAB * HIDDEN * 4 + 32e6


# ------------------------------------------------------------------------------------------ through a model


def tiny_qwen2(attn_implementation: str = "sdpa", tie: bool = True, vocab: int = 96):
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                      attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).float().train()


SEQUENCES = [[3, 17, 22, 9, 41, 5, 60, 90], [11, 2, 33], [7, 7, 50, 21, 19, 88], [44, 1]]


def naive_packed(model, batch, temperature):
    """Full logits from the model's own head, then log-probs and entropy as the trainer did before."""
    kwargs = packed_forward_kwargs(batch, model.config._attn_implementation)
    logits = model(input_ids=batch.input_ids, **kwargs).logits[0]
    lp = torch.cat([logits.new_zeros(1), logprobs_from_logits(logits[:-1], batch.input_ids[0, 1:], temperature)])
    ent = torch.cat([logits.new_zeros(1), entropy_from_logits(logits[:-1].detach() / temperature)])
    keep = batch.label_mask
    return torch.where(keep, lp, torch.zeros_like(lp)), torch.where(keep, ent, torch.zeros_like(ent))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_model_chunked_equals_full_logits(tie):
    """Every parameter's gradient (the tied embedding/head weight gets both uses) matches the full-logits path."""
    model = tiny_qwen2(tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    batch = build_packed_batch(SEQUENCES)
    weights = torch.rand(batch.input_ids.shape[1], generator=torch.Generator().manual_seed(4))

    model.zero_grad()
    want_lp, want_ent = naive_packed(model, batch, 0.8)
    (weights * want_lp).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    lp, ent = packed_logprobs_and_entropy(model, batch, 0.8, chunk_tokens=3)
    (weights * lp).sum().backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-6, rtol=1e-4, msg=name)
    assert "forward" not in model.lm_head.__dict__, "the LM head's own forward is restored"
    assert model(input_ids=batch.input_ids).logits.shape[-1] == 96


def test_wrapped_model_is_called_through_its_wrapper():
    """A wrapper's forward (DDP, DeepSpeed) runs, and the head is found inside it."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, **kwargs):
            self.calls += 1
            return self.module(**kwargs)

    model = tiny_qwen2()
    wrapped = Wrapper(model)
    batch = build_packed_batch(SEQUENCES)
    with torch.no_grad():
        got = packed_logprobs(wrapped, batch, 0.8, chunk_tokens=5)
        want, _ = naive_packed(model, batch, 0.8)
    assert wrapped.calls == 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_model_that_transforms_its_logits_is_refused():
    """Gemma 2 soft-caps the head's output after the head: the chunked log-probs would not be of those logits."""
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=30.0, attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="soft-capping"):
        packed_logprobs(model, build_packed_batch([[1, 2, 3]]), chunk_tokens=2)
    assert "forward" not in model.lm_head.__dict__


# ------------------------------------------------------------------------------------------ attention choice


def test_flash_attention_gets_varlen_arguments_and_no_mask():
    """With flash_attention_2 the forward gets position ids and the varlen lengths, never a [T, T] mask; sdpa
    keeps the block-diagonal mask (CPU behaviour unchanged)."""
    batch = build_packed_batch(SEQUENCES)
    flash = packed_forward_kwargs(batch, "flash_attention_2")
    assert "attention_mask" not in flash
    assert flash["cu_seq_lens_q"] is batch.cu_seqlens and flash["cu_seq_lens_k"] is batch.cu_seqlens
    assert batch.cu_seqlens.tolist() == [0, 8, 11, 17, 19] and batch.cu_seqlens.dtype == torch.int32
    assert flash["max_length_q"] == flash["max_length_k"] == 8
    assert torch.equal(flash["position_ids"], batch.position_ids) and flash["use_cache"] is False
    sdpa = packed_forward_kwargs(batch, "sdpa")
    assert sdpa["attention_mask"].shape == (1, 1, 19, 19) and "cu_seq_lens_q" not in sdpa
    with pytest.raises(ValueError, match="4-D mask"):
        packed_forward_kwargs(batch, "flash_attention_2", attention="mask")


def test_model_forward_with_flash_attention_receives_no_mask():
    """What packed_logprobs hands a model configured for flash-attention (inspected at the forward's entry;
    the kernel itself needs a GPU and flash-attn)."""
    model = tiny_qwen2()
    model.config._attn_implementation = "flash_attention_2"
    seen = {}

    class Stop(Exception):
        pass

    def capture(_module, args, kwargs):
        seen.update(kwargs)
        raise Stop

    model.register_forward_pre_hook(capture, with_kwargs=True)
    with pytest.raises(Stop):
        packed_logprobs(model, build_packed_batch(SEQUENCES))
    assert seen.get("attention_mask") is None and seen["max_length_q"] == 8
    assert seen["cu_seq_lens_q"].tolist() == [0, 8, 11, 17, 19]


def test_varlen_arguments_reach_every_attention_layer(monkeypatch):
    """Stand in for flash-attn's varlen kernel with a per-sequence sdpa that reads only cu_seq_lens (no mask,
    no positions): the packed log-probs equal the masked sdpa ones, so the lengths reach every layer intact."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def varlen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        assert attention_mask is None
        cu, longest = kwargs["cu_seq_lens_q"].tolist(), kwargs["max_length_q"]
        calls.append(module.layer_idx)
        key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        parts = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b],
                                                                    value[:, :, a:b], is_causal=True, scale=scaling)
                 for a, b in zip(cu[:-1], cu[1:], strict=True)]
        assert max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)) == longest
        return torch.cat(parts, 2).transpose(1, 2).contiguous(), None

    model = tiny_qwen2()
    batch = build_packed_batch(SEQUENCES)
    with torch.no_grad():
        want = packed_logprobs(model, batch, 0.9)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", varlen_attention)
    model.config._attn_implementation = "flash_attention_2"
    with torch.no_grad():
        got = packed_logprobs(model, batch, 0.9)
    assert calls == [0, 1]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_auto_attention_implementation():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cuda") == "eager"
    try:
        import flash_attn  # noqa: F401
        has_flash = True
    except ImportError:
        has_flash = False
    assert resolve_attn_implementation("auto", "cuda", 16384) == ("flash_attention_2" if has_flash else "sdpa")


def test_auto_attention_warns_without_flash_attn_on_gpu(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    with caplog.at_level("WARNING", logger="pipelinerl.trainer.forward"):
        assert resolve_attn_implementation("auto", "cuda", 16384) == "sdpa"
    assert "pip install flash-attn --no-build-isolation" in caplog.text and "0.75 GiB" in caplog.text


# ------------------------------------------------------------------------------------------ under ZeRO-3

ROOT = Path(__file__).resolve().parents[1]


def zero3_cfg(checkpointing: bool, chunk: int):
    from pipelinerl.config import TrainerConfig

    return TrainerConfig(lr=3e-3, samples_per_step=4, micro_batch_tokens=12, temperature=0.7, kl_coef=0.05,
                         policy_loss="decoupled_ppo", gradient_checkpointing=checkpointing,
                         logprob_chunk_tokens=chunk)


def zero3_batch():
    from pipelinerl.samples import Sample

    def sample(group, prompt, output, reward):
        return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                      behav_logprobs=[-4.0] * len(output), versions=[0] * len(output), finish_reason="stop",
                      reward=reward)

    return [sample("g0", [5, 6, 7], [10, 11], 1.0), sample("g0", [5, 6, 7], [20, 21, 22, 23, 24, 25], 0.0),
            sample("g1", [8, 9], [30], 0.3), sample("g1", [8, 9], [40, 41], 0.9)]


def zero3_worker(model_dir: str, out: str) -> None:
    """One step under ZeRO-3 with gradient checkpointing and a 2-token LM head chunk (the tied embedding / LM
    head weight is partitioned: the chunked head must run while ZeRO-3 has it gathered, forward and backward)."""
    from pipelinerl.trainer import Trainer

    trainer = Trainer(model_dir, zero3_cfg(checkpointing=True, chunk=2), seed=1)
    layer = trainer.unwrapped_model.model.layers[0]
    calls = []
    layer.register_forward_pre_hook(lambda _m, _i: calls.append(torch.is_grad_enabled()))
    stats = trainer.optimizer_step(zero3_batch())
    params = {n: t.clone() for n, t in trainer.full_parameters()}
    head = trainer.unwrapped_model.get_output_embeddings().weight
    if trainer.accelerator.is_main_process:
        torch.save({"stats": stats, "params": params, "layer_calls": calls, "is_zero3": trainer.is_zero3,
                    "head_partitioned": head.ds_tensor.numel() < head.ds_numel}, out)
    trainer.close()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero3_with_checkpointing_and_chunked_head_matches_one_process(tiny_model_dir, tmp_path):
    """Two CPU ranks under DeepSpeed ZeRO-3 (configs/accelerate/deepspeed_zero3.yaml, gloo), with gradient
    checkpointing and the chunked head, against one process with neither: same loss, entropy, KL and gradient
    norm, and the same parameters after the step; each rank's decoder layers ran twice per training
    micro-batch (the proximal pass runs without grad, once)."""
    from pipelinerl.procs import free_port, tail
    from pipelinerl.trainer import Trainer

    out, log = tmp_path / "zero3.pt", tmp_path / "zero3.log"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           "configs/accelerate/deepspeed_zero3.yaml", "--num_processes", "2", "--main_process_port", str(free_port()),
           str(Path(__file__).resolve()), "zero3", str(tiny_model_dir), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, f"ZeRO-3 trainer exited with {proc.returncode}; log: {log}\n{tail(log)}"
    got = torch.load(out)

    trainer = Trainer(str(tiny_model_dir), zero3_cfg(checkpointing=False, chunk=10**6), seed=1)
    want = trainer.optimizer_step(zero3_batch())
    assert got["is_zero3"] and got["head_partitioned"]
    micro_batches = int(got["stats"]["micro_batches"])
    assert got["layer_calls"].count(False) == micro_batches  # the no-grad proximal pass
    assert got["layer_calls"].count(True) == 2 * micro_batches  # forward, then the recompute in the backward
    for key in ("loss", "entropy", "kl", "grad_norm", "is_weight_mean", "clip_high_frac"):
        assert got["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, t in trainer.full_parameters():
        # Adam's first step is sign-like: a key bias (true gradient 0) moves by +-lr on rounding noise
        atol = 3e-3 if name.endswith("k_proj.bias") else 2e-5
        torch.testing.assert_close(got["params"][name], t, atol=atol, rtol=0, msg=name)


if __name__ == "__main__" and sys.argv[1] == "zero3":
    zero3_worker(sys.argv[2], sys.argv[3])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_entropy_gradient_equals_full_logits(temperature):
    """For an entropy bonus the entropy carries a gradient: d/dz of log p[target] and of H, through the
    recomputed chunks, equal autograd over the full logits (float64 in, float32 softmax inside)."""
    hidden, weight, targets = head_inputs(9, 6, 37, seed=4)
    hidden, weight = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    g = torch.Generator().manual_seed(5)
    g_lp, g_h = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    lp, h = ChunkedHeadLogprobs.apply(hidden, weight, None, targets, temperature, 4, torch.float64, True, True)
    torch.autograd.backward([lp, h], [g_lp.float(), g_h.float()])
    chunked = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.t() / temperature
    (logprobs_from_logits(logits, targets) * g_lp + entropy_from_logits(logits) * g_h).sum().backward()
    for a, b in zip(chunked, (hidden.grad, weight.grad)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    # without entropy_grad the entropy stays out of the graph
    _, h = ChunkedHeadLogprobs.apply(hidden, weight, None, targets, temperature, 4, torch.float64, True, False)
    assert not h.requires_grad
