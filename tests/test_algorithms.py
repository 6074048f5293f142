"""What each RL option does to training, in the real trainer on a tiny model (issue 18): decoupled PPO's
minibatches and behaviour-weight cap, dual-clip, GSPO's defaults, overlong filtering, the entropy bonus, KL in
the reward and its schedules, reference resets and the optimizer reset, and algorithms that plug in by name.
The formulas themselves are tested in test_rl_losses.py and test_rl_advantages.py."""

import math
import sys
import textwrap

import pytest
import torch

from pipelinerl.config import ConfigError, TrainerConfig, load_config
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.rl.kl import KLCoefficient, ReferenceResetPolicy
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("algo_model"), hidden_size=32, num_layers=1, seed=3,
                            initializer_range=0.1)


def sample(group, prompt, output, reward, behav=-2.0, finish="stop", version=0):
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                  behav_logprobs=[behav] * len(output), versions=[version] * len(output), finish_reason=finish,
                  reward=reward)


def batch(behav=-2.0):
    """Two groups of two, one right and one wrong answer each (advantages +-1 under GRPO)."""
    return [sample("a", [5, 6, 7], [10, 11, 12], 1.0, behav), sample("a", [5, 6, 7], [20, 21], 0.0, behav),
            sample("b", [8, 9], [30, 31], 1.0, behav), sample("b", [8, 9], [40, 41, 42, 43], 0.0, behav)]


def make(model_dir, **overrides):
    cfg = dict(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, grad_clip=0.0)
    cfg.update(overrides)
    return Trainer(str(model_dir), TrainerConfig(**cfg), seed=0)


def params(trainer):
    return {n: t.clone() for n, t in trainer.full_parameters()}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


# --- decoupled PPO (AReaL) ---------------------------------------------------------------------------------------


def test_decoupled_ppo_minibatches_clip_against_the_proximal_policy(model_dir):
    """One update per batch: pi = pi_prox, nothing can clip. Four: the later updates have moved the policy away
    from pi_prox (taken before the first) and the clip bounds them, as in AReaL."""
    one = make(model_dir, policy_loss="decoupled_ppo", lr=5e-2).optimizer_step(batch())
    assert one["clip_low_frac"] == one["clip_high_frac"] == 0 and one["updates_applied"] == 1
    trainer = make(model_dir, policy_loss="decoupled_ppo", lr=5e-2, ppo_minibatches=4, samples_per_step=8)
    stats = trainer.optimizer_step(batch() + batch())
    assert stats["updates_applied"] == 4 and trainer.version == 1  # one weight version per batch
    assert stats["clip_frac_first_minibatch"] == 0
    assert stats["clip_frac_later_minibatches"] > 0.2, stats


def test_behav_imp_weight_cap_drops_stale_tokens(model_dir):
    """Tokens whose behaviour weight pi_prox / pi_behav exceeds behav_imp_weight_cap contribute nothing: a batch of
    only such tokens leaves the weights as they were (5 is also the default, AReaL's); without the cap (0) it trains
    (and the weights are e^28)."""
    stale = batch(behav=-30.0)
    capped = make(model_dir, policy_loss="decoupled_ppo", behav_imp_weight_cap=5.0)
    before = params(capped)
    stats = capped.optimizer_step(stale)
    assert stats["behav_capped_frac"] == 1.0 and stats["grad_norm"] == 0 and same(before, params(capped))
    uncapped = make(model_dir, policy_loss="decoupled_ppo", behav_imp_weight_cap=0).optimizer_step(stale)
    assert uncapped["behav_capped_frac"] == 0 and uncapped["grad_norm"] > 1e3


def test_sequence_level_ratio_for_decoupled_ppo(model_dir):
    stats = make(model_dir, policy_loss="decoupled_ppo", importance_sampling_level="sequence", lr=5e-2,
                 ppo_minibatches=4, samples_per_step=8).optimizer_step(batch() + batch())
    assert stats["updates_applied"] == 4 and stats["clip_frac_later_minibatches"] > 0


# --- PPO-clip variants --------------------------------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantage_tokens_with_huge_ratios(model_dir):
    """Samples the engine found very unlikely (behav -30) have ratios ~e^28 now. PPO-clip clips the positive-
    advantage ones but lets the negative ones push with ratio * |A|; dual-clip (clip_ratio_c 3) caps those too, so
    nothing is left to train on."""
    stale = batch(behav=-30.0)
    plain = make(model_dir, policy_loss="ppo_clip").optimizer_step(stale)
    assert plain["grad_norm"] > 1e3 and plain["dual_clip_frac"] == 0
    trainer = make(model_dir, policy_loss="ppo_clip", clip_ratio_c=3.0)
    before = params(trainer)
    dual = trainer.optimizer_step(stale)
    assert dual["dual_clip_frac"] == pytest.approx(6 / 11) and dual["grad_norm"] == 0  # the wrong answers' tokens
    assert same(before, params(trainer))


def test_gspo_takes_its_own_clip_range_and_sequence_mean(model_dir):
    trainer = make(model_dir, policy_loss="gspo")
    assert (trainer.cfg.clip_low, trainer.cfg.clip_high, trainer.cfg.aggregation) == (3e-4, 4e-4, "seq_mean")
    chosen = make(model_dir, policy_loss="gspo", clip_low=1e-3, aggregation="token_mean").cfg
    assert (chosen.clip_low, chosen.clip_high, chosen.aggregation) == (1e-3, 4e-4, "token_mean")
    assert make(model_dir, policy_loss="ppo_clip").cfg.clip_high == 0.28
    # the saved config keeps "unset" (the loss decides), and a loaded gspo config trains with gspo's numbers
    cfg = load_config(None, ["run_dir=x", "model.path=y", "trainer.policy_loss=gspo"])
    assert cfg.trainer.clip_low is None and cfg.trainer.with_algorithm_defaults().clip_low == 3e-4


# --- what enters the loss -----------------------------------------------------------------------------------------


def test_overlong_filtering_leaves_truncated_samples_out_of_the_loss(model_dir):
    """A truncated sample's tokens do not reach the gradient: changing them changes nothing (they still count in
    their group's baseline). Without the filter they do."""
    def with_truncated(tokens):
        b = batch()
        b[1] = sample("a", [5, 6, 7], tokens, 0.0, finish="length")
        return b

    for filtering, equal in ((True, True), (False, False)):
        results = []
        for tokens in ([20, 21], [50, 51]):
            trainer = make(model_dir, overlong_filtering=filtering)
            stats = trainer.optimizer_step(with_truncated(tokens))
            results.append(params(trainer))
        assert same(*results) == equal, filtering
        if filtering:
            assert stats["overlong_filtered"] == 1 and stats["tokens"] == 9


def test_entropy_bonus_raises_entropy(model_dir):
    """With every group's rewards equal (advantages 0) the policy loss has no gradient; the entropy bonus alone
    then raises the policy's entropy step after step."""
    flat = [sample(g, p, o, 1.0) for g, p, o in (("a", [5, 6], [10, 11]), ("a", [5, 6], [12]),
                                                  ("b", [7], [13, 14]), ("b", [7], [15]))]
    assert make(model_dir).optimizer_step(flat)["grad_norm"] == 0
    trainer = make(model_dir, entropy_coef=0.1)
    entropies = [trainer.optimizer_step(flat)["entropy"] for _ in range(5)]
    assert all(b > a for a, b in zip(entropies, entropies[1:])), entropies


# --- KL -----------------------------------------------------------------------------------------------------------


def perturb_reference(trainer, scale=0.5):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            p.add_(scale * torch.randn_like(p))


def test_kl_in_the_reward_shapes_advantages_not_the_loss(model_dir):
    """A group whose rewards are equal has advantage 0, unless the KL is charged in the reward: then samples that
    drifted further from the reference get lower advantages (and no KL term is added to the loss)."""
    flat = [sample("a", [5, 6], [10, 11, 12], 1.0), sample("a", [5, 6], [13], 1.0)]
    in_loss = make(model_dir, samples_per_step=2, kl_coef=0.5)
    perturb_reference(in_loss)
    stats = in_loss.optimizer_step(flat)
    assert stats["adv_std"] == 0 and stats["kl"] > 0 and stats["grad_norm"] > 0  # only the KL loss term trains
    in_reward = make(model_dir, samples_per_step=2, kl_coef=0.5, kl_in_reward=True)
    perturb_reference(in_reward)
    stats = in_reward.optimizer_step(flat)
    assert stats["adv_std"] > 0.5 and stats["kl_penalty_mean"] > 0


def test_kl_coefficient_schedules():
    linear = KLCoefficient(0.1, "linear", end=0.0, steps=4)
    assert [round(linear.at_step(s), 6) for s in range(6)] == [0.1, 0.075, 0.05, 0.025, 0.0, 0.0]
    adaptive = KLCoefficient(0.1, "adaptive", target=0.01, horizon=100)
    adaptive.update(kl=0.1, num_samples=10)  # far above target: +20% x 10/100
    assert adaptive.at_step(1) == pytest.approx(0.1 * 1.02)
    adaptive.update(kl=0.0, num_samples=10)
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 0.98)
    assert KLCoefficient(0.3).at_step(100) == 0.3


def test_linear_kl_schedule_reaches_the_trainer(model_dir):
    trainer = make(model_dir, kl_coef=0.2, kl_schedule="linear", kl_coef_end=0.0, kl_schedule_steps=2)
    assert [trainer.optimizer_step(batch())["kl_coef"] for _ in range(3)] == pytest.approx([0.2, 0.1, 0.0])


def test_reference_reset_on_a_kl_spike_and_with_the_optimizer(model_dir):
    trainer = make(model_dir, kl_coef=0.1, ref_reset_kl=1e-3, ref_reset_optimizer=True)
    perturb_reference(trainer)
    stats = trainer.optimizer_step(batch())
    assert stats["kl"] > 1e-3 and stats["ref_reset"] == 1
    ref = dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], t) for n, t in trainer.full_parameters())
    state = trainer.optimizer.optimizer.state
    assert state and all(float(v.abs().sum()) == 0 for s in state.values() for v in s.values() if torch.is_tensor(v))
    # the policy is its own reference now: no spike, no reset, and the optimizer moves again
    stats = trainer.optimizer_step(batch())
    assert stats["ref_reset"] == 0 and stats["kl"] < 1e-3
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in state.values())


def test_reference_reset_when_validation_stagnates(model_dir):
    trainer = make(model_dir, kl_coef=0.1, ref_reset_patience=2)
    for score in (0.5, 0.6, 0.55):  # a new best, then one evaluation without improvement
        trainer.note_eval_score(score)
    assert trainer.optimizer_step(batch())["ref_reset"] == 0
    trainer.note_eval_score(0.6)  # not better than the best: two in a row
    assert trainer.optimizer_step(batch())["ref_reset"] == 1
    assert trainer.optimizer_step(batch())["ref_reset"] == 0  # patience starts again after a reset
    policy = ReferenceResetPolicy(every_n_steps=3, patience=1)
    assert [policy.should_reset(s) for s in (1, 2, 3, 4, 5, 6)] == [False, False, True, False, False, True]


def test_resets_need_a_reference():
    with pytest.raises(ConfigError, match="trainer.kl_coef"):
        TrainerConfig(ref_reset_patience=3)
    with pytest.raises(ConfigError, match="trainer.kl_in_reward"):
        TrainerConfig(kl_in_reward=True)


# --- algorithms plug in by name -----------------------------------------------------------------------------------


def test_a_loss_of_ones_own_plugs_in_by_dotted_path(model_dir, tmp_path, monkeypatch):
    """A recipe can name a loss in a file of its own; the trainer calls it like a built-in one, with its defaults
    and its own arguments."""
    (tmp_path / "my_algos.py").write_text(textwrap.dedent("""
        from pipelinerl.rl.registry import register_policy_loss

        calls = []

        @register_policy_loss("half_reinforce", clip=(0.1, 0.1), aggregation="token_mean")
        def half_reinforce(logprobs, inputs, cfg):
            calls.append(cfg.policy_loss_args["scale"])
            loss = -cfg.policy_loss_args["scale"] * inputs.advantages * logprobs
            return loss.where(inputs.mask, 0.0), {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["run_dir=x", "model.path=y", "trainer.policy_loss=my_algos:half_reinforce",
                             "trainer.policy_loss_args.scale=0.5"])
    trainer = Trainer(str(model_dir), cfg.trainer, seed=0)
    assert (trainer.cfg.clip_low, trainer.cfg.aggregation) == (0.1, "token_mean")
    stats = trainer.optimizer_step(batch())
    assert sys.modules["my_algos"].calls == [0.5] and stats["grad_norm"] > 0 and math.isfinite(stats["loss"])
    with pytest.raises(ConfigError, match="trainer.policy_loss: unknown policy loss 'ppo'; registered: decoupled_ppo"):
        load_config(None, ["run_dir=x", "model.path=y", "trainer.policy_loss=ppo"])
    with pytest.raises(ConfigError, match="trainer.advantage: .*no_such_module"):
        load_config(None, ["run_dir=x", "model.path=y", "trainer.advantage=no_such_module:f"])
