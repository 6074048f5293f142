"""The embedded engine's fast forward (`SlotRunner`) in process: its logits equal the transformers model's
through a batched prefill and decode steps, whichever linear kernel each weight shape was given, and the
per-shape kernel choice (`LinearKernels`) computes F.linear for every row count."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pipelinerl.engines.embedded.model_runner import TIMED_MAX_ROWS, LinearKernels, SlotRunner, _onednn_usable

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not _onednn_usable(CPU, torch.float32), reason="no oneDNN in this torch build")


def forced(kernels: LinearKernels, pattern) -> LinearKernels:
    """The same shapes, with the choice per row bucket set by `pattern(bucket)` instead of the timing."""
    for choices in kernels.use_onednn.values():
        choices[:] = [bool(pattern(k)) for k in range(len(choices))]
    return kernels


@needs_onednn
@pytest.mark.parametrize("pattern", [lambda k: True, lambda k: False, lambda k: k % 2],
                         ids=["onednn", "blas", "alternating"])
def test_linear_kernels_compute_linear_for_every_row_count(pattern):
    g = torch.Generator().manual_seed(0)
    shapes = [(48, 32, True), (96, 32, False), (32, 64, True)]
    kernels = forced(LinearKernels(shapes, torch.float32, CPU, repeats=1), pattern)
    assert set(kernels.use_onednn) == {(48, 32), (96, 32), (32, 64)}
    for out_f, in_f, has_bias in shapes:
        w = torch.randn(out_f, in_f, generator=g)
        b = torch.randn(out_f, generator=g) if has_bias else None
        for rows in (1, 2, 3, 7, 33, TIMED_MAX_ROWS, TIMED_MAX_ROWS + 100):
            x = torch.randn(rows, in_f, generator=g)
            torch.testing.assert_close(kernels(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_linear_kernels_summary_names_each_run_of_row_counts():
    kernels = forced(LinearKernels([(16, 8, False)], torch.float32, CPU, repeats=1), lambda k: k >= 4)
    assert kernels.summary() == {"16x8": "blas for 1-4, onednn for 8+ rows"}
    assert kernels.any_onednn
    assert not forced(kernels, lambda k: False).any_onednn


@pytest.mark.parametrize("kernel", ["blas", "onednn"])
def test_slot_runner_logits_equal_transformers(tiny_model_dir, kernel):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = SlotRunner(model, num_slots=4, max_len=32, onednn=kernel == "onednn")
    if kernel == "onednn":
        if not runner.onednn:
            pytest.skip("no oneDNN in this torch build")
        runner.linear = forced(LinearKernels(runner._linear_shapes(), torch.float32, CPU, repeats=1),
                               lambda k: True)
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
