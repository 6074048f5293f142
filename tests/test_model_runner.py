"""The embedded engine's fast forward (`SlotRunner`) in process: its logits equal the transformers model's
through a batched prefill and decode steps, whichever storage layout and linear kernel each weight shape was
given, and the per-shape choice (`LinearKernels`) computes F.linear for every row count."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pipelinerl.engines.embedded import transpose
from pipelinerl.engines.embedded.linear_kernels import TIMED_MAX_ROWS, LinearKernels, onednn_usable
from pipelinerl.engines.embedded.packed import PackedLayout, linear_packed, packed_copier
from pipelinerl.engines.embedded.slot_runner import SlotRunner
from pipelinerl.engines.embedded.transpose import transposed_copy

CPU = torch.device("cpu")
HAS_ONEDNN = onednn_usable(CPU, torch.float32)
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="no oneDNN in this torch build")
# packed copies (packed.py) where this CPU's oneDNN reads float32 weights as the panels the engine writes
HAS_PACKED = HAS_ONEDNN and PackedLayout.of(128, 64) is not None
needs_packed = pytest.mark.skipif(not HAS_PACKED, reason="oneDNN on this CPU (or torch) wants weights in a layout "
                                                           "other than packed.py's panels: no packed copies")


def forced(kernels: LinearKernels, pattern) -> LinearKernels:
    """The same shapes, with the choice per row bucket set by `pattern(bucket)` (True: oneDNN)."""
    for choices in kernels.use_onednn.values():
        choices[:] = [bool(pattern(k)) for k in range(len(choices))]
    return kernels


@needs_onednn
@pytest.mark.parametrize("stored", ["as-is", "transposed"])
@pytest.mark.parametrize("pattern", [lambda k: True, lambda k: False, lambda k: k % 2],
                         ids=["onednn", "blas", "alternating"])
def test_linear_kernels_compute_linear_for_every_row_count(pattern, stored):
    g = torch.Generator().manual_seed(0)
    shapes = [(48, 32, True), (96, 32, False), (32, 64, True)]
    kernels = forced(LinearKernels.fixed(shapes, transposed=stored == "transposed"), pattern)
    assert set(kernels.use_onednn) == {(48, 32), (96, 32), (32, 64)}
    for out_f, in_f, has_bias in shapes:
        w = torch.randn(out_f, in_f, generator=g)
        b = torch.randn(out_f, generator=g) if has_bias else None
        weight = transposed_copy(w) if (out_f, in_f) in kernels.transposed else w
        assert weight.is_contiguous() == (stored == "as-is")
        for rows in (1, 2, 3, 7, 33, TIMED_MAX_ROWS, TIMED_MAX_ROWS + 100):
            x = torch.randn(rows, in_f, generator=g)
            torch.testing.assert_close(kernels(x, weight, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_packed
def test_a_packed_copy_multiplies_as_its_weight_and_sees_every_write_into_its_panels():
    """oneDNN multiplies by a view of the panels the engine fills (and an update rewrites) in ordinary memory:
    for every row count, the product is F.linear's with the weight the panels were last filled from."""
    g = torch.Generator().manual_seed(0)
    tested = 0
    for out_f, in_f, has_bias in [(128, 64, True), (64, 256, False), (192, 48, True)]:
        layout = PackedLayout.of(out_f, in_f)
        if layout is None:  # this CPU's oneDNN blocks this shape otherwise (an AVX2 EPYC: in_features 48)
            continue
        tested += 1
        w = torch.randn(out_f, in_f, generator=g)
        b = torch.randn(out_f, generator=g) if has_bias else None
        panels, fill = packed_copier(w)
        fill()
        view = layout.view(panels)
        assert view.is_mkldnn and view.panels is panels
        for rows in (1, 3, 32, 100):
            x = torch.randn(rows, in_f, generator=g)
            torch.testing.assert_close(linear_packed(x, view, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        new_w = torch.randn(out_f, in_f, generator=g)  # an update: the same panels refilled, the same view
        _, refill = packed_copier(new_w, out=panels)
        refill()
        x = torch.randn(5, in_f, generator=g)
        torch.testing.assert_close(linear_packed(x, view, b), F.linear(x, new_w, b), atol=1e-4, rtol=1e-4)
    assert tested >= 1  # (128, 64) at least: needs_packed checked it
    assert PackedLayout.of(100, 64) is None and PackedLayout.of(128, 40) is None  # not whole panels: no copy


def test_timed_kernels_decide_every_shape_and_row_bucket():
    shapes = [(48, 32, True), (96, 32, False), (32, 64, True), (96, 32, False)]
    for onednn in [False, True] if HAS_ONEDNN else [False]:
        kernels = LinearKernels.timed(shapes, torch.float32, CPU, onednn=onednn, repeats=1)
        assert set(kernels.use_onednn) == {(48, 32), (96, 32), (32, 64)}
        assert kernels.transposed <= set(kernels.use_onednn)
        for choices in kernels.use_onednn.values():
            assert len(choices) == TIMED_MAX_ROWS.bit_length() + 1 and not choices[0]
        if not onednn:
            assert not kernels.any_onednn


def test_linear_kernels_summary_names_the_storage_and_each_run_of_row_counts():
    kernels = forced(LinearKernels.fixed([(16, 8, False)]), lambda k: k >= 4)
    assert kernels.summary() == {"16x8": "blas for 1-4, onednn for 8+ rows"}
    assert kernels.any_onednn
    assert not forced(kernels, lambda k: False).any_onednn
    kernels = LinearKernels.fixed([(16, 8, False)], transposed=True)
    assert kernels.summary() == {"16x8": "transposed copy; blas for 1+ rows"}


@pytest.mark.parametrize("kernel,attention", [("blas", "cpu"), ("onednn", "cpu"), ("transposed-blas", "cpu"),
                                              ("transposed-onednn", "cpu"), ("packed", "cpu"),
                                              ("blas", "keys-as-is"), ("blas", "sdpa")])
def test_slot_runner_logits_equal_transformers(tiny_model_dir, kernel, attention):
    """`attention`: "cpu", what a CPU runs (batched matmuls, keys stored transposed); "keys-as-is", the same
    with keys stored position by position; "sdpa", what other devices run (scaled_dot_product_attention)."""
    if "onednn" in kernel and not HAS_ONEDNN:
        pytest.skip("no oneDNN in this torch build")
    if kernel == "packed" and not HAS_PACKED:
        pytest.skip("no packed copies on this CPU")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    transposed, packed = kernel.startswith("transposed"), kernel == "packed"
    choose = partial(LinearKernels.fixed, transposed=transposed, onednn=kernel.endswith("onednn"), packed=packed)
    runner = SlotRunner(model, num_slots=4, max_len=32, choose_kernels=choose)
    assert runner.manual_attention and not runner.keys[0].is_contiguous()  # the CPU's choices
    if attention != "cpu":
        runner.manual_attention = attention == "keys-as-is"
        runner._init_kv_cache(keys_transposed=False)
        assert runner.keys[0].is_contiguous()
    attn = model.model.layers[0].self_attn
    # the model's own parameters are views of the fused buffers that a weight switch replaces...
    qkv_live = runner.fused_groups[0][0]
    assert attn.k_proj.weight.data_ptr() == qkv_live[attn.q_proj.out_features].data_ptr()
    # ...and the runner multiplies by those, or by copies stored transposed
    layer = runner.layers[0]
    assert (layer.qkv_w is qkv_live) != (transposed or packed)
    for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w):
        if packed:  # oneDNN's views of packed copies (every projection's shape is whole panels)
            assert w.is_mkldnn
        else:
            assert w.is_contiguous() != transposed and w.t().is_contiguous() == transposed
    # the head tied to the embedding: multiplied by a copy of its own too, the lookups read the live weight
    # (not packed: the tiny vocabulary, 100 rows, is not whole panels of 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight and runner._embed_w is model.lm_head.weight
    assert (runner._head_w is model.lm_head.weight) != transposed
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # different lengths: padding and the decode mask
    logits = runner.prefill_batch([0, 1, 2], prompts)
    sequences = [list(p) for p in prompts]
    for _ in range(4):
        for seq, row in zip(sequences, logits):
            with torch.no_grad():
                expected = reference(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
        tokens = logits.argmax(-1)
        positions = torch.tensor([len(s) for s in sequences])
        for seq, t in zip(sequences, tokens.tolist()):
            seq.append(t)
        logits = runner.decode(tokens, positions)


@pytest.mark.parametrize("layout", ["transposed", "packed"])
def test_copies_of_new_weights_are_built_before_the_switch_into_retired_memory(tiny_model_dir, layout):
    """What the engine does around an update: copies built from the received weights while the old copies are
    in use, taken into use at the switch; the next update's copies go into the memory the switch retired."""
    if layout == "packed" and not HAS_PACKED:
        pytest.skip("no packed copies on this CPU")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = SlotRunner(model, num_slots=2, max_len=16, transposed="all" if layout == "transposed" else "packed")
    # q/k/v, o, gate/up, down per layer, and the tied head (transposed; its 100 rows are not whole panels)
    assert len(runner.relayout_slots) == 2 * 4 + (layout == "transposed")
    assert set(runner.relayout_layouts) == {layout}
    prompt = [5, 6, 7, 8]

    def logits_equal_reference() -> bool:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]
        return torch.allclose(runner.prefill_batch([0], [prompt])[0], expected, atol=1e-4, rtol=1e-4)

    assert logits_equal_reference()
    retired: dict[int, int] = {}
    for scale in (1.5, 0.75):  # the weights become 1.5x and 0.75x those the runner's live weights still hold
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "proj" in name:
                    p.copy_(dict(model.named_parameters())[name] * scale)
            # the projections' slots (the head's copy follows the embedding it is tied to: test_engine's updates)
            incoming = {slot: live.detach() * scale for slot, (_, _, live) in enumerate(runner.relayout_slots)
                        if live is not runner._embed_w}
        copies = runner.build_copies(incoming)
        assert not logits_equal_reference()  # built, not yet in use: still the old weights
        if retired:  # the second update writes into the first update's retired copies: no allocation
            assert {slot: c.data_ptr() for slot, c in copies.items()} == retired
        in_use = {slot: _memory(getattr(holder, attr)).data_ptr()
                  for slot, (holder, attr, _) in enumerate(runner.relayout_slots) if slot in incoming}
        runner.use_copies(copies)
        retired = in_use
        qkv = runner.layers[0].qkv_w
        assert logits_equal_reference() and (qkv.is_mkldnn if layout == "packed" else not qkv.is_contiguous())


def _memory(operand: torch.Tensor) -> torch.Tensor:
    """What holds an operand's values: a packed copy's view reads its panels."""
    return operand.panels if operand.is_mkldnn else operand


@pytest.mark.parametrize("mkl", [True, False], ids=["mkl", "torch"])
@pytest.mark.parametrize("shape", [(48, 32), (1200, 640), (0, 8)], ids=["small", "large", "empty"])  # 3 MB
def test_transposed_copy_has_every_value_and_the_transposed_layout(shape, mkl, monkeypatch):
    if mkl and transpose._mkl_omatcopy(torch.float32) is None:
        pytest.skip("no MKL in this torch build")
    if not mkl:
        monkeypatch.setattr(transpose, "_mkl_omatcopy", lambda dtype: None)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        copy = transposed_copy(w[:, 1:][:, :-1] if shape[1] > 2 else w)  # a non-contiguous source too
        assert torch.equal(copy, w[:, 1:][:, :-1] if shape[1] > 2 else w) and copy.t().is_contiguous()
