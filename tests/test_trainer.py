"""The trainer on CPU: weight broadcast to a real engine process, exact resume from a checkpoint, learning on a
toy problem, bad batches, skipped non-finite steps, HF export."""

import math

import httpx
import pytest
import torch
from conftest import running_engine
from transformers import AutoModelForCausalLM

from pipelinerl.config import TrainerConfig, WeightSyncConfig
from pipelinerl.engines.embedded.engine import tensor_checksums
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.procs import free_port
from pipelinerl.rl import build_packed_batch
from pipelinerl.samples import Sample
from pipelinerl.trainer import (
    Trainer,
    build_step,
    checkpoint_dir,
    clean_name,
    export_hf,
    group_advantages,
    latest_checkpoint,
    load_checkpoint,
    lr_factor,
    sample_advantages,
    save_checkpoint,
    set_sample_advantages,
)
from pipelinerl.trainer.forward import packed_logprobs
from pipelinerl.weight_sync import TensorSpec, in_wire_layout, plan_buckets, sibling_order


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """Smaller than the engine tests' model: the learning tests run hundreds of steps."""
    return build_tiny_model(tmp_path_factory.mktemp("small_model"), hidden_size=32, num_layers=1, seed=7,
                            initializer_range=0.1)


def sample(group, prompt, output, reward, behav=None, version=0):
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                  behav_logprobs=behav if behav is not None else [-4.0] * len(output),
                  versions=[version] * len(output), finish_reason="stop", reward=reward)


def toy_batch(i=0):
    """Two groups with different rewards; contents vary with `i` so consecutive steps differ."""
    return [sample("g0", [5, 6, 7 + i % 3], [10, 11 + i % 5], 1.0, version=i // 2),
            sample("g0", [5, 6, 7 + i % 3], [20, 21, 22], 0.0, version=i // 2),
            sample("g1", [8, 9], [30 + i % 4], 0.3, version=i // 2),
            sample("g1", [8, 9], [40, 41], 0.9, version=max(0, i // 2 - 1))]


def params(trainer):
    return {n: t.clone() for n, t in trainer.full_parameters()}


def assert_same_params(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for n in a:
        if atol == 0.0:
            assert torch.equal(a[n], b[n]), n
        else:
            torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0, msg=n)


def in_send_order(trainer):
    """The trainer's parameters in the order a broadcast sends them."""
    named = list(trainer.full_parameters())
    return [named[i][1] for i in sibling_order([n for n, _ in named])]


def seq_logprob(trainer, prompt, output):
    """log p(output | prompt) under the trainer's current policy (at its temperature)."""
    with torch.no_grad():
        batch = build_packed_batch([prompt + output])
        lp = packed_logprobs(trainer.model, batch, trainer.cfg.temperature)
    return float(lp[len(prompt):].sum()), lp[len(prompt):].tolist()


# ------------------------------------------------------------------------------------ broadcast to an engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with running_engine(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                        extra=["--max-model-len", "64", "--max-running-seqs", "8"]) as client:
        yield client


@pytest.fixture(scope="module")
def engine_trainer(engine, tiny_model_dir):
    cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, temperature=0.7)
    trainer = Trainer(str(tiny_model_dir), cfg, WeightSyncConfig(master_port=0, timeout_s=30))
    group = trainer.connect_engines([engine.url])
    yield trainer, group
    group.destroy()
    trainer.close()


@pytest.mark.parametrize("bucket_mb", [0.01, 0.0], ids=["buckets", "per-tensor"])
def test_broadcast_reaches_engine_bit_for_bit(engine, engine_trainer, bucket_mb):
    trainer, group = engine_trainer
    trainer.sync_cfg.bucket_mb = bucket_mb
    for i in range(3):  # in a row: the engine receives into two arenas in turn, the trainer sends in place
        before = httpx.get(f"{engine.url}/v1/weights/checksum").json()
        trainer.optimizer_step(toy_batch(i))
        named = list(trainer.full_parameters())
        if bucket_mb:
            assert len(plan_buckets([TensorSpec.of(n, t) for n, t in named], trainer.bucket_bytes)) >= 4
        stats = trainer.broadcast_weights(group, [engine.url])

        after = httpx.get(f"{engine.url}/v1/weights/checksum").json()
        local = tensor_checksums(dict(trainer.full_parameters()))
        assert after["version"] == trainer.version == stats.version
        assert {n: after["checksums"][n] for n in local} == local
        assert after["checksums"] != before["checksums"]
        assert engine.info().weight_version == trainer.version
        assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named) and stats.seconds > 0
        assert "lm_head.weight" not in dict(named), "a tied weight is sent once, under the embedding's name"
        assert in_wire_layout(in_send_order(trainer), trainer.bucket_bytes)


def test_engine_samples_are_on_policy_for_the_trainer(engine, engine_trainer):
    """Engine log-probs at temperature 0.7 match the trainer's temperature-scaled log-probs: importance weights
    are 1 and the lag is 0 right after a broadcast."""
    trainer, group = engine_trainer
    trainer.broadcast_weights(group, [engine.url])
    prompt = [5, 6, 7, 8]
    out = engine.generate(prompt, temperature=0.7, max_new_tokens=12, n=4, seed=3, ignore_eos=True)
    batch = [Sample(group_id="p", prompt_token_ids=prompt, output_token_ids=c.token_ids,
                    behav_logprobs=c.logprobs, versions=c.versions, finish_reason=c.finish_reason,
                    reward=float(i % 2)) for i, c in enumerate(out.completions)]
    stats = trainer.optimizer_step(batch)
    assert stats["lag_mean"] == stats["lag_max"] == 0
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert stats["is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert stats["ess"] == pytest.approx(1.0, abs=1e-4)
    assert stats["tokens"] == 48 and stats["samples"] == 4


@pytest.fixture()
def fresh_accelerate_state():
    """accelerate keeps one process-wide state and refuses a second precision in the same process (a trainer
    process has one Trainer): start from none, and leave none for the tests after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_trainer_to_a_bf16_engine(tiny_model_dir, tmp_path, fresh_accelerate_state):
    """The GPU setting (bf16 autocast in the trainer, a bfloat16 engine, bf16 on the wire), run on CPU: the
    steps move fp32 master weights, and the engine ends up holding their bfloat16 rounding bit for bit."""
    with running_engine(tiny_model_dir, tmp_path, extra=["--dtype", "bfloat16", "--max-model-len", "64"]) as engine:
        cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, mixed_precision="bf16")
        trainer = Trainer(str(tiny_model_dir), cfg, WeightSyncConfig(master_port=0, timeout_s=30),
                          dtype="bfloat16")
        group = trainer.connect_engines([engine.url])
        try:
            assert trainer.accelerator.mixed_precision == "bf16"
            master = next(trainer.model.parameters())
            assert master.dtype == torch.float32, "master weights stay float32"
            before = master.detach().clone()
            for i in range(2):
                stats = trainer.optimizer_step(toy_batch(i))
                assert stats["skipped"] == 0 and math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
                trainer.broadcast_weights(group, [engine.url])
            assert not torch.equal(master, before)
            named = dict(trainer.full_parameters())
            assert {t.dtype for t in named.values()} == {torch.bfloat16}
            after = httpx.get(f"{engine.url}/v1/weights/checksum").json()
            assert after["version"] == trainer.version == 2
            assert {n: after["checksums"][n] for n in named} == tensor_checksums(named)
            # and the engine generates with them, labelled with the new version
            out = engine.generate([5, 6, 7, 8], temperature=0.0, max_new_tokens=4, ignore_eos=True)
            assert len(out.completions[0].token_ids) == 4 and set(out.completions[0].versions) == {2}
        finally:
            group.destroy()
            trainer.close()


# ------------------------------------------------------------------------------------ checkpoint and resume


def resume_cfg():
    return TrainerConfig(lr=3e-3, weight_decay=0.1, warmup_steps=2, schedule="cosine", max_steps=6,
                         samples_per_step=4, micro_batch_tokens=12, kl_coef=0.05, ref_reset_every=3,
                         policy_loss="decoupled_ppo")


def test_save_kill_resume_matches_uninterrupted_run(small_model_dir, tmp_path):
    total, at = 5, 2
    straight = Trainer(str(small_model_dir), resume_cfg(), seed=1)
    for i in range(total):
        straight.optimizer_step(toy_batch(i))
    expected_params, expected_next = params(straight), straight.optimizer_step(toy_batch(total))

    first = Trainer(str(small_model_dir), resume_cfg(), seed=1)
    for i in range(at):
        first.optimizer_step(toy_batch(i))
    save_checkpoint(first, checkpoint_dir(tmp_path, at), {"next_batch": at})
    del first  # "killed": the resumed trainer only sees the files

    resumed = Trainer(str(small_model_dir), resume_cfg(), seed=99)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, at)
    position = load_checkpoint(resumed, latest_checkpoint(tmp_path))
    assert position == {"next_batch": at} and resumed.version == at and resumed.step == at
    for i in range(position["next_batch"], total):
        resumed.optimizer_step(toy_batch(i))
    assert resumed.version == straight.version - 1 == total
    assert_same_params(params(resumed), expected_params)
    got_next = resumed.optimizer_step(toy_batch(total))
    for key in ("loss", "kl", "lr", "grad_norm"):
        assert got_next[key] == pytest.approx(expected_next[key], abs=1e-6), key
    assert got_next["ref_reset"] == expected_next["ref_reset"] == 1  # the reset clock survived the resume


def test_a_cpu_trainer_steps_with_the_fused_adamw_to_the_default_ones_values(small_model_dir, tmp_path):
    """On CPU the policy's and the critic's AdamW are torch's fused one (a loop of a dozen operations per tensor
    otherwise: bench in build_optimizer's docstring), kept over a resume, and a step moves the weights where the
    default AdamW moves them."""
    def inner(optimizer):
        return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's

    cfg = TrainerConfig(lr=3e-3, weight_decay=0.1, samples_per_step=4, micro_batch_tokens=12, advantage="gae")
    trainer = Trainer(str(small_model_dir), cfg, seed=1)
    for opt in (trainer.optimizer, trainer.critic.optimizer):
        assert all(g["fused"] for g in inner(opt).param_groups)
    reference = Trainer(str(small_model_dir), cfg, seed=1)
    for opt in (reference.optimizer, reference.critic.optimizer):
        for g in inner(opt).param_groups:
            g["fused"] = None  # torch's default on CPU: one tensor at a time
    start = params(trainer)
    for i in range(3):
        trainer.optimizer_step(toy_batch(i))
        reference.optimizer_step(toy_batch(i))
    assert_same_params(params(trainer), params(reference), atol=1e-6)
    assert max(float((got - start[n]).abs().max()) for n, got in params(trainer).items()) > 1e-3
    save_checkpoint(trainer, checkpoint_dir(tmp_path, 3), {})
    save_checkpoint(reference, checkpoint_dir(tmp_path / "unfused", 3), {})  # as one saved before AdamW was fused
    for saved in (checkpoint_dir(tmp_path, 3), checkpoint_dir(tmp_path / "unfused", 3)):
        resumed = Trainer(str(small_model_dir), cfg, seed=2)
        load_checkpoint(resumed, saved)
        for opt in (resumed.optimizer, resumed.critic.optimizer):
            assert all(g["fused"] for g in inner(opt).param_groups), saved


def test_parameters_laid_out_for_the_wire_train_save_and_resume_the_same(small_model_dir, tmp_path):
    """A bucketed broadcast re-points the parameters into the wire's bucket buffers (so later broadcasts send
    from them in place). Training, checkpoints (accelerate's safetensors saving deduplicates tensors by
    storage) and resume must not see a difference."""
    plain = Trainer(str(small_model_dir), resume_cfg(), seed=1)
    laid = Trainer(str(small_model_dir), resume_cfg(), WeightSyncConfig(bucket_mb=0.01), seed=1)
    assert laid.lay_out_for_broadcast()  # what the first bucketed broadcast_weights does
    tensors = in_send_order(laid)
    assert in_wire_layout(tensors, laid.bucket_bytes)
    assert len(plan_buckets([TensorSpec.of(str(i), t) for i, t in enumerate(tensors)], laid.bucket_bytes)) >= 3
    for i in range(3):
        plain.optimizer_step(toy_batch(i))
        laid.optimizer_step(toy_batch(i))
    assert_same_params(params(laid), params(plain))
    assert in_wire_layout(in_send_order(laid), laid.bucket_bytes)  # stepped in place
    state = laid.unwrapped_model.state_dict()
    assert state.keys() == plain.unwrapped_model.state_dict().keys()
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(tensors)  # tied: one copy

    save_checkpoint(laid, checkpoint_dir(tmp_path, 3), {})
    resumed = Trainer(str(small_model_dir), resume_cfg(), seed=99)
    load_checkpoint(resumed, checkpoint_dir(tmp_path, 3))
    assert_same_params(params(resumed), params(plain))
    load_checkpoint(laid, checkpoint_dir(tmp_path, 3))  # loading into laid-out parameters keeps the layout
    assert in_wire_layout(in_send_order(laid), laid.bucket_bytes)
    for i in range(3, 5):
        for trainer in (plain, laid, resumed):
            trainer.optimizer_step(toy_batch(i))
    assert_same_params(params(laid), params(plain))
    assert_same_params(params(resumed), params(plain))


def test_latest_checkpoint_ignores_incomplete_and_overwrite_is_atomic(small_model_dir, tmp_path):
    trainer = Trainer(str(small_model_dir), TrainerConfig(samples_per_step=4, micro_batch_tokens=16))
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(trainer, checkpoint_dir(tmp_path, 0), {"epoch": 0})
    trainer.optimizer_step(toy_batch())
    save_checkpoint(trainer, checkpoint_dir(tmp_path, 1), {"epoch": 1})
    (tmp_path / "checkpoints" / ".tmp-step_00000009").mkdir()  # a crash mid-save
    (tmp_path / "checkpoints" / "step_00000008").mkdir()  # no trainer_state.json: incomplete
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    save_checkpoint(trainer, checkpoint_dir(tmp_path, 1), {"epoch": 2})  # overwrite in place
    assert load_checkpoint(trainer, checkpoint_dir(tmp_path, 1)) == {"epoch": 2}
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(trainer, tmp_path / "checkpoints" / "step_00000008")


# ------------------------------------------------------------------------------------ learning


@pytest.mark.parametrize("loss", ["reinforce_is", "ppo_clip", "decoupled_ppo", "gspo"])
def test_policy_moves_towards_the_rewarded_completion(small_model_dir, loss):
    cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=32, policy_loss=loss, grad_clip=1.0)
    trainer = Trainer(str(small_model_dir), cfg, seed=0)
    prompt, good, bad = [5, 6, 7], [10, 11], [20, 21]
    good_0, good_lp = seq_logprob(trainer, prompt, good)
    bad_0, bad_lp = seq_logprob(trainer, prompt, bad)
    batch = [sample("g", prompt, good, 1.0, good_lp), sample("g", prompt, bad, 0.0, bad_lp)] * 2
    for _ in range(150):
        stats = trainer.optimizer_step(batch)
    good_1, bad_1 = seq_logprob(trainer, prompt, good)[0], seq_logprob(trainer, prompt, bad)[0]
    assert good_1 > good_0 + 0.2 and bad_1 < bad_0 - 0.2, (good_0, good_1, bad_0, bad_1)
    assert stats["skipped"] == 0 and trainer.version == 150
    if loss == "reinforce_is":  # unclipped: it goes all the way to the optimum
        assert math.exp(good_1) > 0.9


def test_micro_batching_accumulates_to_the_same_update(small_model_dir):
    """Gradients summed over micro-batches equal the one-micro-batch gradient (Adam's first step is
    sign-like, so the parameters themselves are not a sharp test)."""
    batch = toy_batch(1)
    for aggregation in ("token_sum_norm", "token_mean", "seq_mean"):
        results = []
        for budget in (64, 6):  # one micro-batch, then one per sample
            cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=budget, aggregation=aggregation)
            trainer = Trainer(str(small_model_dir), cfg)
            grads = {}
            step = trainer.optimizer.step

            def capture(*args, trainer=trainer, grads=grads, step=step, **kwargs):
                grads.update({n: p.grad.clone() for n, p in trainer.unwrapped_model.named_parameters()})
                return step(*args, **kwargs)

            trainer.optimizer.step = capture
            results.append((grads, trainer.optimizer_step(batch)))
        (one, one_stats), (many, many_stats) = results
        assert one_stats["micro_batches"] == 1 and many_stats["micro_batches"] == 4
        for key in ("loss", "grad_norm", "entropy", "is_weight_mean"):
            assert one_stats[key] == pytest.approx(many_stats[key], rel=1e-5, abs=1e-6), (aggregation, key)
        assert_same_params(one, many, atol=1e-6)


def batch_with_groups_without_spread():
    """One group whose rewards differ and two whose answers all got the same reward (advantage 0 under grpo)."""
    return [sample("mixed", [5, 6, 7], [10, 11], 1.0), sample("mixed", [5, 6, 7], [20, 21, 22], 0.0),
            sample("same", [8, 9], [30], 0.5), sample("same", [8, 9], [40, 41], 0.5),
            sample("wrong", [3], [12, 13, 14], 0.0), sample("wrong", [3], [15], 0.0)]


def all_alike_batch():
    """One group whose answers all got the same reward: no advantage anywhere."""
    return [sample("all", [4], [7, 8], 1.0), sample("all", [4], [9], 1.0)]


def skip_cfg(**kw):
    return TrainerConfig(**{"lr": 1e-2, "samples_per_step": 6, "micro_batch_tokens": 6, "policy_loss": "ppo_clip",
                            "aggregation": "token_mean", "advantage": "grpo", **kw})


@pytest.mark.parametrize("loss,aggregation", [("ppo_clip", "token_sum_norm"), ("reinforce_is", "token_mean"),
                                              ("gspo", "seq_mean"), ("decoupled_ppo", "token_sum_norm")])
def test_samples_without_advantage_are_left_out_of_the_passes_for_the_same_update(small_model_dir, loss,
                                                                                   aggregation):
    """trainer.skip_zero_advantage: the 4 samples of the two groups without reward spread go through no forward
    or backward pass, and the update is the one of the whole batch: the same gradients, and after a second step
    on a batch with no advantage anywhere (zero gradients: AdamW's momentum still moves the weights), the same
    weights."""
    runs = {}
    for skip in (True, False):
        cfg = skip_cfg(policy_loss=loss, aggregation=aggregation, skip_zero_advantage=skip)
        trainer = Trainer(str(small_model_dir), cfg, seed=3)
        stats, grads = step_with_grads(trainer, batch_with_groups_without_spread())
        second, second_grads = step_with_grads(trainer, all_alike_batch())
        runs[skip] = stats, grads, second, second_grads, params(trainer)
    (skipped, grads, second, second_grads, weights), (full, full_grads, _, _, full_weights) = runs[True], runs[False]
    assert skipped["samples_left_out"] == 4 and skipped["tokens_left_out"] == 1 + 2 + 3 + 1
    assert full["samples_left_out"] == 0
    assert skipped["micro_batches"] == 2 and full["micro_batches"] == 5  # at most 6 tokens a micro-batch
    assert skipped["tokens"] == 5 and full["tokens"] == 12
    assert skipped["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, full_grads[name], atol=1e-7, rtol=1e-5, msg=name)
    # nothing to pass through: one zero-weight pass, the update still made (momentum), as without skipping
    assert second["samples_left_out"] == 2 and second["micro_batches"] == 1 and second["tokens"] == 0
    assert second["skipped"] == 0.0 and all(float(g.abs().max()) == 0 for g in second_grads.values())
    assert_same_params(weights, full_weights, atol=1e-6)


@pytest.mark.parametrize("setting", [{"entropy_coef": 0.01}, {"kl_coef": 0.1}, {"advantage": "gae"}])
def test_samples_without_advantage_stay_where_another_term_needs_them(small_model_dir, setting):
    """An entropy bonus, a KL term or a critic gives every sample a gradient: nothing is left out."""
    trainer = Trainer(str(small_model_dir), skip_cfg(**setting))
    assert not trainer.skips_zero_advantage
    stats = trainer.optimizer_step(batch_with_groups_without_spread())
    assert stats["samples_left_out"] == 0 and stats["micro_batches"] == 5


def full_logits_expectation(trainer, batch, temperature):
    """The step's reinforce_is loss and mean entropy from the model's full [tokens, vocab] logits, one sample
    at a time: what the trainer computed before its LM head was chunked."""
    from pipelinerl.rl import entropy_from_logits, logprobs_from_logits

    step = build_step(batch, 64)
    advantages = group_advantages(step.samples, "grpo")
    loss, entropy, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for s, adv in zip(step.samples, advantages.tolist(), strict=True):
            ids = torch.tensor([s.prompt_token_ids + s.output_token_ids])
            rows = trainer.unwrapped_model(ids).logits[0, len(s.prompt_token_ids) - 1:-1]
            lp = logprobs_from_logits(rows, torch.tensor(s.output_token_ids), temperature)
            w = torch.exp(lp - torch.tensor(s.behav_logprobs)).clamp(max=trainer.cfg.is_cap)
            loss += float((-w * adv * lp).sum()) / trainer.cfg.samples_per_step
            entropy += float(entropy_from_logits(rows / temperature).sum())
            tokens += len(s.output_token_ids)
    return loss, entropy / tokens


@pytest.mark.parametrize("loss", ["reinforce_is", "decoupled_ppo"])
def test_chunked_lm_head_step_equals_full_logits(small_model_dir, loss):
    """The LM head one token at a time or all at once (`trainer.logprob_chunk_tokens`): the same loss, entropy
    and gradients (Adam's first update is sign-like, so the updated parameters are not a sharp test); and the
    loss and entropy are those of full logits. decoupled_ppo with a KL term also runs the no-grad proximal and
    reference passes through the chunked head."""
    batch = toy_batch(2)
    results = []
    for chunk in (1, 10**6):
        cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=10, temperature=0.7, policy_loss=loss,
                            kl_coef=0.1 if loss == "decoupled_ppo" else 0.0, logprob_chunk_tokens=chunk)
        trainer = Trainer(str(small_model_dir), cfg)
        expected = full_logits_expectation(trainer, batch, 0.7)
        stats, grads = step_with_grads(trainer, batch)
        results.append((stats, grads, expected))
    (one, one_grads, expected), (whole, whole_grads, _) = results
    assert one["micro_batches"] == 2
    for key in ("loss", "entropy", "grad_norm", "kl", "is_weight_mean", "clip_high_frac"):
        assert one[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert_same_params(one_grads, whole_grads, atol=1e-7)
    assert one["entropy"] == pytest.approx(expected[1], rel=1e-5)
    if loss == "reinforce_is":
        assert one["loss"] == pytest.approx(expected[0], rel=1e-5)


def grouped_batch(i=0):
    """Two groups of three short answers to 6- and 5-token prompts (the shape of the tiny recipe's batches), the
    samples of a group not side by side: sharing the prompts packs 14 + 14 tokens instead of 26 + 24."""
    a, b = [5, 6, 7, 8, 9, 10 + i % 3], [11, 12, 13, 14, 15]
    return [sample("a", a, [20, 21 + i % 4], 1.0), sample("b", b, [30, 31, 32], 0.0),
            sample("a", a, [22, 23, 24], 0.0, behav=[-3.0, -4.5, -5.0]), sample("b", b, [33, 34, 35], 1.0),
            sample("a", a, [25, 26, 27 + i % 2], 0.8), sample("b", b, [36, 37 + i % 3, 38], 0.2)]


@pytest.mark.parametrize("setting", [{}, {"policy_loss": "decoupled_ppo", "kl_coef": 0.1},
                                     {"entropy_coef": 0.01, "aggregation": "seq_mean", "temperature": 0.7}])
def test_shared_prompts_train_as_the_whole_sequences(small_model_dir, setting):
    """trainer.share_prompts: each group's prompt goes through the model once (fewer `model_tokens`), and the
    step is the one on whole sequences: the same loss, stats and gradients, and a second step's stats the same
    (Adam's first update is sign-like: the weights are no sharp test); with decoupled_ppo and a KL term the no-grad
    proximal and reference passes take the shared rows too."""
    runs = {}
    for share in (True, False):
        cfg = TrainerConfig(lr=1e-2, samples_per_step=6, micro_batch_tokens=64, share_prompts=share, **setting)
        trainer = Trainer(str(small_model_dir), cfg, seed=3)
        stats, grads = step_with_grads(trainer, grouped_batch())
        second, _ = step_with_grads(trainer, grouped_batch(1))
        runs[share] = stats, grads, second
    (shared, shared_grads, shared_second), (whole, whole_grads, whole_second) = runs[True], runs[False]
    assert whole["model_tokens"] == 50 and shared["model_tokens"] == 50 - 2 * 6 - 2 * 5
    assert shared["micro_batches"] == whole["micro_batches"] == 1
    for key in ("loss", "entropy", "kl", "grad_norm", "is_weight_mean", "clip_low_frac", "clip_high_frac",
                "tokens"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
        assert shared_second[key] == pytest.approx(whole_second[key], rel=1e-4, abs=1e-6), key
    assert any(float(g.abs().max()) > 0 for g in whole_grads.values())
    for name, g in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_prompts_are_not_shared_where_the_layout_cannot_say_it(small_model_dir):
    """A critic reads every sequence back whole, and flash-attention's varlen kernel has no mask: no sharing
    there; and none where the answers are long enough that a dense mask over them costs more than the prompts
    saved."""
    assert Trainer(str(small_model_dir), TrainerConfig(samples_per_step=6))._share_prompts is not None
    assert Trainer(str(small_model_dir), TrainerConfig(samples_per_step=6, advantage="gae"))._share_prompts is None
    trainer = Trainer(str(small_model_dir), TrainerConfig(samples_per_step=4, micro_batch_tokens=4096))
    long_answers = [sample("g", [5, 6, 7, 8], [10 + j % 50] * 900, float(j % 2)) for j in range(4)]
    assert trainer.optimizer_step(long_answers)["model_tokens"] == 4 * 904


def test_gradient_checkpointing_recomputes_layers_for_the_same_gradients(small_model_dir):
    """`trainer.gradient_checkpointing` on packed micro-batches with the chunked head: each decoder layer runs
    twice per micro-batch (forward, then again in the backward) instead of once, and the gradients and stats
    are those without it."""
    batch = toy_batch(3)
    results = []
    for checkpointing in (False, True):
        cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=10, temperature=0.7,
                            gradient_checkpointing=checkpointing, logprob_chunk_tokens=3)
        trainer = Trainer(str(small_model_dir), cfg)
        layer = trainer.unwrapped_model.model.layers[0]
        assert layer.gradient_checkpointing == checkpointing
        calls = []
        # a pre-hook: the recompute stops early, once it has what the backward needs, so post-hooks miss it
        layer.register_forward_pre_hook(lambda _m, _i, calls=calls: calls.append(torch.is_grad_enabled()))
        stats, grads = step_with_grads(trainer, batch)
        results.append((stats, grads, calls))
    (plain, plain_grads, plain_calls), (ckpt, ckpt_grads, ckpt_calls) = results
    assert plain["micro_batches"] == ckpt["micro_batches"] == 2
    assert len(plain_calls) == 2 and len(ckpt_calls) == 4
    for key in ("loss", "entropy", "grad_norm", "is_weight_mean"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-8), key
    assert_same_params(ckpt_grads, plain_grads, atol=1e-7)


DDP_WORKER = """
import json, sys
from pipelinerl.trainer import Trainer, load_checkpoint, save_checkpoint
from test_trainer import (all_alike_batch, batch_with_groups_without_spread, ddp_batch, ddp_cfg, skip_cfg,
                          step_with_grads)

model_dir, out, ckpt = sys.argv[1:4]
trainer = Trainer(model_dir, ddp_cfg())
if trainer.accelerator.is_main_process:  # as a bucketed broadcast does, on the main process only
    assert trainer.lay_out_for_broadcast()
stats, grads = step_with_grads(trainer, ddp_batch())
save_checkpoint(trainer, ckpt, {"rank_count": trainer.accelerator.num_processes})
assert load_checkpoint(trainer, ckpt) == {"rank_count": 2}
# samples without advantage left out: the ranks share the 2 packed ones, then a step with none, one pass each
skipping = Trainer(model_dir, skip_cfg())
skip_stats, skip_grads = step_with_grads(skipping, batch_with_groups_without_spread())
skip_grads = {n: g.tolist() for n, g in skip_grads.items()}
skip_second = skipping.optimizer_step(all_alike_batch())
if trainer.accelerator.is_main_process:
    json.dump({"stats": stats, "grads": {n: g.tolist() for n, g in grads.items()},
               "params": {n: t.tolist() for n, t in trainer.full_parameters()},
               "skip": {"stats": [skip_stats, skip_second], "grads": skip_grads,
                        "params": {n: t.tolist() for n, t in skipping.full_parameters()}}}, open(out, "w"))
"""


def ddp_cfg():
    return TrainerConfig(lr=1e-2, samples_per_step=5, micro_batch_tokens=8, aggregation="seq_mean", kl_coef=0.1,
                         policy_loss="decoupled_ppo")


def ddp_batch():
    """Uneven lengths: rank 0 packs samples 0, 2, 4 into two micro-batches, rank 1 packs 1, 3 into one and
    must run a padding pass."""
    return [sample("a", [5, 6, 7], [10, 11, 12, 13, 14], 1.0), sample("a", [5, 6, 7], [20], 0.0),
            sample("b", [8], [30, 31], 0.2), sample("b", [8], [40, 41, 42], 0.7), sample("b", [8], [50], 0.1)]


def step_with_grads(trainer, batch):
    """One optimizer step, and the gradients its optimizer update saw."""
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.unwrapped_model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    try:
        return trainer.optimizer_step(batch), grads
    finally:  # a later step must not write into this step's gradients
        trainer.optimizer.step = step


@pytest.mark.slow
def test_two_data_parallel_ranks_match_one_process(small_model_dir, tmp_path):
    """Two CPU ranks under torchrun (accelerate's MULTI_CPU, DDP over gloo): same gradients and stats as one
    process, though the ranks pack different numbers of micro-batches; checkpoints save and load."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "worker.py").write_text(DDP_WORKER)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(tmp_path / "worker.py"), str(small_model_dir), str(tmp_path / "out.json"),
           str(tmp_path / "ckpt")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    multi = json.loads((tmp_path / "out.json").read_text())

    stats, grads = step_with_grads(Trainer(str(small_model_dir), ddp_cfg()), ddp_batch())
    assert multi["stats"]["micro_batches"] == 2 and stats["micro_batches"] == 3
    for key in ("loss", "grad_norm", "kl", "entropy", "tokens", "is_weight_mean", "ess", "adv_std"):
        assert multi["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(multi["grads"][name]), g, atol=1e-7, rtol=1e-5, msg=name)

    # leaving samples without advantage out on two ranks: the update of one process passing every sample through
    full = Trainer(str(small_model_dir), skip_cfg(skip_zero_advantage=False))
    full_stats, full_grads = step_with_grads(full, batch_with_groups_without_spread())
    full.optimizer_step(all_alike_batch())
    first, second = multi["skip"]["stats"]
    assert first["samples_left_out"] == 4 and first["micro_batches"] == 1  # each rank one of the 2 packed samples
    assert second["samples_left_out"] == 2 and second["micro_batches"] == 1 and second["skipped"] == 0
    assert first["loss"] == pytest.approx(full_stats["loss"], rel=1e-5, abs=1e-7)
    for name, g in full_grads.items():
        torch.testing.assert_close(torch.tensor(multi["skip"]["grads"][name]), g, atol=1e-7, rtol=1e-5, msg=name)
    for name, t in full.full_parameters():
        torch.testing.assert_close(torch.tensor(multi["skip"]["params"][name]), t, atol=1e-6, rtol=0, msg=name)


def test_kl_penalty_and_reference_reset(small_model_dir):
    cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=32, kl_coef=0.1, ref_reset_every=2)
    trainer = Trainer(str(small_model_dir), cfg)
    assert trainer.ref_model is not None
    first = trainer.optimizer_step(toy_batch())
    second = trainer.optimizer_step(toy_batch())
    assert first["kl"] == 0 and second["kl"] > 0 and second["ref_reset"] == 1
    ref = {n: p for n, p in trainer.ref_model.named_parameters()}
    assert all(torch.equal(ref[n], t) for n, t in trainer.full_parameters())
    assert trainer.optimizer_step(toy_batch())["kl"] == 0  # the reference is the policy again
    assert Trainer(str(small_model_dir), TrainerConfig()).ref_model is None  # only built when kl_coef > 0


def test_a_far_reference_is_a_bounded_kl_not_a_skipped_step(small_model_dir):
    """k3 against a reference far from the policy (its LM head scaled up a thousandfold: log-ratios in the
    thousands) is bounded per token, so one outlier token cannot dominate the loss (unclamped, this batch's KL
    stat was 2960); the step is applied with a finite gradient. The overflow to inf is tested in test_rl_losses."""
    from pipelinerl.rl.kl import K3_MAX

    cfg = TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=32, kl_coef=0.1, kl_estimator="k3")
    trainer = Trainer(str(small_model_dir), cfg)
    with torch.no_grad():
        trainer.ref_model.get_output_embeddings().weight.mul_(1e3)
    stats = trainer.optimizer_step(toy_batch())
    assert stats["skipped"] == 0 and math.isfinite(stats["grad_norm"]) and math.isfinite(stats["loss"])
    assert 0 < stats["kl"] <= K3_MAX


def test_build_step_advantages_and_packing():
    step = build_step(toy_batch(), micro_batch_tokens=8)
    advantages = sample_advantages(step, TrainerConfig(advantage="grpo"))
    assert advantages.tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert step.num_output_tokens == 8
    mbs = step.micro_batches
    set_sample_advantages(mbs, advantages)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == [0, 1, 2, 3]
    assert all(mb.num_tokens <= 8 for mb in mbs)
    for mb in mbs:
        f = mb.packed.fields
        for j, i in enumerate(mb.sample_indices):
            s = step.samples[i]
            rows = mb.packed.seq_ids == j
            assert mb.packed.input_ids[0, rows].tolist() == s.prompt_token_ids + s.output_token_ids
            assert f["loss_mask"][rows].tolist() == [False] * len(s.prompt_token_ids) + [True] * len(
                s.output_token_ids)
            assert f["behav_logprobs"][rows][f["loss_mask"][rows]].tolist() == s.behav_logprobs
            assert f["advantages"][rows].tolist() == pytest.approx([float(advantages[i])] * int(rows.sum()))
            assert mb.packed.position_ids[0, rows].tolist() == list(range(int(rows.sum())))
    # two data-parallel ranks split the samples but keep whole-batch advantages and counts
    halves = [build_step(toy_batch(), 8, rank=r, world_size=2) for r in range(2)]
    assert [sorted(i for mb in h.micro_batches for i in mb.sample_indices) for h in halves] == [[0, 2], [1, 3]]
    assert all(h.num_output_tokens == 8 for h in halves)


def test_lr_schedule():
    assert [lr_factor(s, 2, 10, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [lr_factor(s, 2, 10, "cosine") for s in range(11)]
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[6] == pytest.approx(0.5) and cosine[10] == pytest.approx(0)
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))


def test_clean_name_strips_wrapper_prefixes():
    assert clean_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert clean_name("_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.x.weight") == \
        "model.layers.0.x.weight"
    assert clean_name("model.submodule.weight") == "model.submodule.weight"


# ------------------------------------------------------------------------------------ bad input, bad steps


def _bad(kind):
    good = toy_batch()
    if kind == "lengths":
        s = good[1]
        good[1] = Sample.model_construct(**{**s.__dict__, "behav_logprobs": s.behav_logprobs[:-1]})
    elif kind == "nan_reward":
        good[1] = good[1].model_copy(update={"reward": float("nan")})
    elif kind == "nan_logprob":
        good[1] = good[1].model_copy(update={"behav_logprobs": [-1.0, float("nan"), -1.0]})
    elif kind == "empty":
        good[1] = sample("g0", [5, 6], [], 0.0)
    elif kind == "too_long":
        good[1] = sample("g0", [5] * 10, [6] * 10, 0.0)
    elif kind == "mapping":
        good[1] = {**good[1].model_dump(), "versions": [0]}
    return good


@pytest.mark.parametrize("kind, message", [
    ("lengths", "3 output tokens but 2 log-probs"),
    ("nan_reward", "reward is nan"),
    ("nan_logprob", "log-prob of output token 1 is nan"),
    ("empty", "empty output"),
    ("too_long", "20 tokens .* exceed micro_batch_tokens 16"),
    ("mapping", "not a valid sample"),
])
def test_bad_batch_is_refused_naming_the_sample(small_model_dir, kind, message):
    trainer = Trainer(str(small_model_dir), TrainerConfig(samples_per_step=4, micro_batch_tokens=16))
    before = params(trainer)
    with pytest.raises(ValueError, match=r"sample 1 \(group_id 'g0'\): .*" + message):
        trainer.optimizer_step(_bad(kind))
    assert trainer.version == 0
    assert_same_params(params(trainer), before)
    with pytest.raises(ValueError, match="empty batch"):
        trainer.optimizer_step([])


@pytest.mark.parametrize("where", ["gradient", "loss"])
def test_non_finite_step_is_skipped(small_model_dir, where, caplog):
    trainer = Trainer(str(small_model_dir), TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=16,
                                                          warmup_steps=5))
    trainer.optimizer_step(toy_batch())  # so there is optimizer state to protect
    before, lr = params(trainer), trainer.lr
    adam = {k: v.clone() for k, v in trainer.optimizer.state[next(trainer.model.parameters())].items()}
    model = trainer.unwrapped_model
    if where == "gradient":
        handle = model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * float("nan"))
    else:
        handle = model.lm_head.register_forward_hook(lambda _m, _i, out: out * float("inf"))
    stats = trainer.optimizer_step(toy_batch(1))
    handle.remove()

    assert stats["skipped"] == 1 and trainer.version == 1 and stats["version"] == 1
    assert "update skipped" in caplog.text
    assert_same_params(params(trainer), before)
    assert trainer.lr == lr  # the schedule did not advance either
    state = trainer.optimizer.state[next(trainer.model.parameters())]
    assert all(torch.equal(state[k], v) for k, v in adam.items())
    after = trainer.optimizer_step(toy_batch(1))
    assert after["skipped"] == 0 and trainer.version == 2 and math.isfinite(after["grad_norm"])


# ------------------------------------------------------------------------------------ export


def test_export_loads_with_transformers_and_matches(small_model_dir, tmp_path):
    trainer = Trainer(str(small_model_dir), TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=16))
    trainer.optimizer_step(toy_batch())
    out = export_hf(trainer, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    mine = dict(trainer.full_parameters())
    theirs = dict(model.named_parameters())
    assert theirs.keys() == mine.keys()
    assert all(torch.equal(theirs[n], mine[n]) for n in mine)
    assert torch.equal(model.lm_head.weight, mine["model.embed_tokens.weight"])  # still tied
    assert (out / "tokenizer.json").is_file() and model.config.use_cache


def test_trainer_implements_the_contract(small_model_dir):
    from pipelinerl.contracts.trainer import TrainerBackend

    trainer = Trainer(str(small_model_dir), TrainerConfig(samples_per_step=4, micro_batch_tokens=16))
    assert isinstance(trainer, TrainerBackend) and trainer.version == 0
    stats = trainer.optimizer_step([s.model_dump() for s in toy_batch()])  # plain mappings are accepted
    assert trainer.version == 1 and stats["version"] == 1 and stats["samples"] == 4
