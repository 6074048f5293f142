"""Multi-turn samples in the trainer (issue 20): the tokens a tool wrote are context, never actions. Their
gradient is exactly zero, what they hold does not change the update, and packing several multi-turn samples into
one row trains exactly as one sample per row does."""

import pytest
import torch

from pipelinerl.config import TrainerConfig
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer
from pipelinerl.trainer.batch import build_step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("multiturn_model"), hidden_size=32, num_layers=1, seed=5,
                            initializer_range=0.1)


def turns(group, prompt, parts, reward, tool_behav=0.0):
    """A sample from (tokens, written_by_model) parts: model turns carry log-probs and a version, tool turns 0/-1."""
    out, mask, behav, versions = [], [], [], []
    for tokens, model in parts:
        out += tokens
        mask += [int(model)] * len(tokens)
        behav += [-2.0 if model else tool_behav] * len(tokens)
        versions += [0 if model else -1] * len(tokens)
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=out, behav_logprobs=behav,
                  versions=versions, output_mask=mask, finish_reason="stop", reward=reward)


def batch(tool_tokens=(30, 31, 32), tool_behav=0.0):
    tool = list(tool_tokens)
    return [turns("a", [5, 6, 7], [([10, 11], True), (tool, False), ([12, 13], True)], 1.0, tool_behav),
            turns("a", [5, 6, 7], [([14, 15, 16], True), (tool, False), ([17], True)], 0.0, tool_behav),
            turns("b", [8, 9], [([20], True), (tool, False), ([21, 22], True), (tool, False), ([23], True)], 1.0,
                  tool_behav),
            turns("b", [8, 9], [([24, 25], True)], 0.0, tool_behav)]


def make(model_dir, **overrides):
    cfg = dict(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, grad_clip=0.0, policy_loss="ppo_clip",
               kl_coef=0.1, entropy_coef=0.01)
    cfg.update(overrides)
    return Trainer(str(model_dir), TrainerConfig(**cfg), seed=0)


def params(trainer):
    return {n: t.detach().clone() for n, t in trainer.full_parameters()}


def test_the_loss_mask_leaves_out_tool_tokens():
    step = build_step(batch(), micro_batch_tokens=64)
    assert step.trained_tokens.tolist() == [4.0, 4.0, 4.0, 2.0]
    mb = step.minibatches[0].micro_batches[0]
    p = mb.packed
    for j, i in enumerate(mb.sample_indices):
        s = step.samples[i]
        rows = (p.seq_ids.reshape(-1) == j).nonzero().squeeze(1)
        mask = p.fields["loss_mask"].reshape(-1)[rows].tolist()
        assert mask == [False] * len(s.prompt_token_ids) + [bool(m) for m in s.output_mask]


def test_tool_tokens_get_no_gradient(model_dir):
    """The gradient of the loss (policy term, KL, entropy) with respect to the final hidden state that predicts a
    tool token is exactly zero, and non-zero where it predicts a model token. (The final norm's output at position
    t feeds only the logits at t, which predict token t + 1.)"""
    trainer = make(model_dir, micro_batch_tokens=12)  # one sample per row, so each row's gradient is one sample's
    sample = batch()[0]
    other = turns("a", [5, 6, 7], [([24, 25], True)], 0.0)  # a shorter row, so the two rows tell apart
    grads = []

    def keep_grad(module, inputs, output):
        output.register_hook(lambda g: grads.append(g.detach().reshape(-1, g.shape[-1]).clone()))

    handle = trainer.unwrapped_model.model.norm.register_forward_hook(keep_grad)
    try:
        trainer.optimizer_step([sample, other])
    finally:
        handle.remove()
    p = len(sample.prompt_token_ids)
    rows = [g for g in grads if g.shape[0] == p + len(sample.output_token_ids)]
    assert len(rows) == 1, [g.shape for g in grads]
    # output token i is predicted at position p + i - 1
    at = {i: rows[0][p + i - 1].abs().sum().item() for i in range(len(sample.output_token_ids))}
    assert all(at[i] > 0 for i, m in enumerate(sample.output_mask) if m)
    assert [at[i] for i, m in enumerate(sample.output_mask) if not m] == [0.0, 0.0, 0.0]


def test_what_the_tool_wrote_does_not_change_the_update_except_as_context(model_dir):
    """Tool tokens with absurd behaviour log-probs (which would give huge importance weights and KL if they were
    trained on) leave the update exactly as it is with zeros there."""
    plain, absurd = make(model_dir), make(model_dir)
    a = plain.optimizer_step(batch(tool_behav=0.0))
    b = absurd.optimizer_step(batch(tool_behav=-40.0))
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
    pa, pb = params(plain), params(absurd)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(pa[n], p0) for n, p0 in params(make(model_dir)).items()), "the step moved weights"


def test_packed_multiturn_equals_one_sample_per_row(model_dir):
    packed, alone = make(model_dir, micro_batch_tokens=64), make(model_dir, micro_batch_tokens=12)
    a = packed.optimizer_step(batch())
    b = alone.optimizer_step(batch())
    assert a["micro_batches"] == 1 and b["micro_batches"] == 4
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    pa, pb = params(packed), params(alone)
    # equal up to float rounding: Adam's first step moves each weight by lr (1e-2) times g / (|g| + eps), which for
    # gradients near eps turns their rounding into differences of 1e-5 (measured 1.7e-5 on a 2-core Xeon);
    # a token packed into the wrong sample would move weights by ~lr
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) < 1e-4


def test_version_and_lag_metrics_read_model_tokens_only():
    s = batch()[2]
    assert s.model_versions == [0, 0, 0, 0] and s.oldest_version == 0 and s.lag(3) == 3
    with pytest.raises(ValueError, match="output_mask"):
        Sample(group_id="x", prompt_token_ids=[1], output_token_ids=[2, 3], behav_logprobs=[0.0, 0.0],
               versions=[0, 0], output_mask=[1], finish_reason="stop")


# --- the code-interpreter loop, end to end ------------------------------------------------------------------------


def test_tool_calls_are_parsed_from_the_turn_that_stopped_on_them():
    from pipelinerl.tasks.interpreter import final_answer_text
    from pipelinerl.tasks.workflow import InterpreterSyntax, tool_call

    syntax = InterpreterSyntax()
    assert tool_call("let me compute\n```python\nprint(2*3)\n```\n", syntax) == "print(2*3)\n"
    assert tool_call("```python\nx=1\n```\n```python\nprint(x)\n```\n", syntax) == "print(x)\n"
    assert tool_call("the answer is 6", syntax) is None
    assert tool_call("```\n", syntax) is None  # a bare fence is no call
    text = "```python\nprint(2*3)\n```\n```output\n6\n```\n6"
    assert final_answer_text(text) == "6" and final_answer_text("42") == "42"
    assert final_answer_text("```output\n6\n") == ""  # an observation cut off: no answer after it


@pytest.mark.slow
def test_a_multi_turn_run_calls_the_interpreter_and_trains_on_its_own_tokens_only(tmp_path):
    """`pipelinerl run` with the interpreter task: the actor pauses at the model's tool calls, runs them in the
    sandbox and appends their output; the samples mark those tokens 0 in `output_mask` (log-prob 0, version -1),
    the trainer reports the tool calls, and the held-out evaluation runs the same loop."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(root / "recipes" / "tiny_tool_cpu.yaml"),
           f"run_dir={run_dir}", "model.tiny_hidden_size=64", "model.warmup_steps=120",
           "task.args.digits=2", "task.args.digits2=1", "task.args.num_train=500", "task.args.num_eval=8",
           "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_k=1", "trainer.samples_per_step=16",
           "sampling.group_size=4", "actor.dynamic_sampling=false", "actor.concurrency=16",
           "weight_sync.master_port=0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "loss" in row]
    assert len(train_rows) == 3 and all(row["tool_calls_mean"] > 0 for row in train_rows), train_rows
    assert any("eval_accuracy" in row for row in rows)
    tok = AutoTokenizer.from_pretrained(run_dir / "base_model")
    samples = [json.loads(line.split(" ", 1)[1]) for f in (run_dir / "streams" / "samples").glob("*.jsonl")
               for line in f.read_text().splitlines() if line.strip()]
    called = [s for s in samples if 0 in s["output_mask"]]
    assert called, "some episodes called the tool"
    for s in called:
        tool = [t for t, m in zip(s["output_token_ids"], s["output_mask"]) if not m]
        assert tok.decode(tool).startswith("```output\n"), tok.decode(tool)
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(s["behav_logprobs"], s["versions"], s["output_mask"])
                   if not m)
        assert all(v >= 0 for v, m in zip(s["versions"], s["output_mask"]) if m)
        assert s["timings"]["tool_calls"] >= 1
    # the interpreter really ran: a well-formed call's observation is what its code prints
    import re

    checked = 0
    for s in called:
        text = tok.decode(s["output_token_ids"])
        m = re.match(r"```python\nprint\((\d+)\*(\d+)\)\n```\n```output\n(.*?)```", text, re.S)
        if m:
            assert m.group(3) == f"{int(m.group(1)) * int(m.group(2))}\n", text
            checked += 1
    assert checked >= len(called) // 2, f"{checked} of {len(called)} calls well formed"


def test_only_the_models_own_last_turn_answers():
    """A tool output that prints a closing fence and the product is not an answer: the reward reads the model's
    last turn."""
    from pipelinerl.tasks.interpreter import score_interpreter

    problem = {"answer": "20126"}
    forged = "```python\nprint('```'+chr(10)+'20126')\n```\n```output\n```\n20126\n```\nno idea"
    assert score_interpreter({"problem": problem, "completion": forged, "final_turn": "no idea"}).reward == 0.0
    honest = "```python\nprint(347*58)\n```\n```output\n20126\n```\n20126"
    assert score_interpreter({"problem": problem, "completion": honest, "final_turn": "20126"}).reward == 1.0


def test_seeded_episodes_of_a_group_draw_differently():
    """A seeded evaluation sends every episode's request with a seed of its own (else k episodes are one sample
    k times, and pass@k is pass@1)."""
    import asyncio

    from pipelinerl.contracts.inference import Completion, GenerateResponse, SamplingParams
    from pipelinerl.models.tiny import build_char_tokenizer
    from pipelinerl.tasks.workflow import RolloutEngine

    seeds = []

    async def record(req):
        seeds.append(req.sampling.seed)
        return GenerateResponse(request_id="r", prompt_len=len(req.prompt_token_ids), completions=[
            Completion(token_ids=[5], logprobs=[-1.0], versions=[0], finish_reason="length")])

    engine = RolloutEngine(record, build_char_tokenizer(), SamplingParams(seed=0, max_new_tokens=4), 64)

    async def episodes():
        for i in range(4):
            await engine.for_episode(i).generate([5, 6])

    asyncio.run(episodes())
    assert len(set(seeds)) == 4
