"""Every algorithm option does what its name and its reference say (issue 48), in the real trainer on a tiny model:
a setting the chosen algorithm would ignore is a config error naming the key; the proximal log-probs reach any loss
that updates more than once per batch; GSPO's trust region is taken around the proximal policy; decoupled PPO caps
its behaviour weight by default; token_sum_norm divides by the batch trained; every statistic a loss returns is
logged; the KL in the reward is charged per sample or as each token's reward-to-go; the presets load onto any
recipe and are the papers' settings."""

import sys
import textwrap

import pytest
import torch

from pipelinerl.config import ConfigError, CriticConfig, TrainerConfig, load_config, preset_names
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.rl.kl import kl_to_go
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("options_model"), hidden_size=32, num_layers=1, seed=3,
                            initializer_range=0.1)


def sample(group, prompt, output, reward, behav=-2.0, version=0):
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                  behav_logprobs=[behav] * len(output), versions=[version] * len(output), finish_reason="stop",
                  reward=reward)


def batch(behav=-2.0, version=0):
    return [sample("a", [5, 6, 7], [10, 11, 12], 1.0, behav, version),
            sample("a", [5, 6, 7], [20, 21], 0.0, behav, version),
            sample("b", [8, 9], [30, 31], 1.0, behav, version),
            sample("b", [8, 9], [40, 41, 42, 43], 0.0, behav, version)]


def make(model_dir, **overrides):
    cfg = dict(lr=1e-2, samples_per_step=4, micro_batch_tokens=64, grad_clip=0.0)
    cfg.update(overrides)
    return Trainer(str(model_dir), TrainerConfig(**cfg), seed=0)


# --- settings the chosen algorithm does not read ------------------------------------------------------------------


@pytest.mark.parametrize("setting,algorithm,reader", [
    (dict(clip_ratio_c=3.0), dict(policy_loss="gspo"), "ppo_clip"),
    (dict(clip_ratio_c=3.0), dict(policy_loss="reinforce_is"), "decoupled_ppo"),
    (dict(behav_imp_weight_cap=5.0), dict(policy_loss="ppo_clip"), "decoupled_ppo"),
    (dict(importance_sampling_level="sequence"), dict(policy_loss="ppo_clip"), "decoupled_ppo"),
    (dict(is_cap=2.0), dict(policy_loss="ppo_clip"), "reinforce_is"),
    (dict(clip_low=0.1), dict(policy_loss="reinforce_is"), "ppo_clip"),
    (dict(whiten_over="tokens"), dict(advantage="grpo"), "reinforce_pp_baseline"),
    (dict(group_std_unbiased=True), dict(advantage="rloo"), "grpo"),
    (dict(critic=CriticConfig(updates=4)), dict(advantage="grpo"), "gae"),
    (dict(policy_loss_args={"beta": 1}), dict(policy_loss="ppo_clip"), "a loss of your own"),
])
def test_a_setting_the_algorithm_does_not_read_is_an_error_naming_it(setting, algorithm, reader):
    key = next(iter(setting))
    with pytest.raises(ConfigError, match=rf"trainer\.{key}: .* would have no effect") as e:
        TrainerConfig(**setting, **algorithm)
    assert reader in str(e.value) and next(iter(algorithm.values())) in str(e.value)
    # and on the command line, through a recipe, the same message
    overrides = [f"trainer.{k}={v}" for k, v in algorithm.items()]
    if key != "critic" and key != "policy_loss_args":
        overrides.append(f"trainer.{key}={setting[key]}")
        with pytest.raises(ConfigError, match=rf"trainer\.{key}"):
            load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=/tmp/unused", *overrides])


def test_the_settings_each_algorithm_reads_are_accepted():
    TrainerConfig(policy_loss="ppo_clip", clip_ratio_c=3.0, clip_low=0.1)
    TrainerConfig(policy_loss="decoupled_ppo", behav_imp_weight_cap=3.0, importance_sampling_level="sequence")
    TrainerConfig(policy_loss="gspo", behav_imp_weight_cap=3.0)
    TrainerConfig(advantage="reinforce_pp_baseline", whiten_over="tokens")
    TrainerConfig(advantage="gae", critic=CriticConfig(updates=4))


def test_kl_reward_settings_that_cannot_mean_what_they_say():
    with pytest.raises(ConfigError, match="trainer.kl_reward: 'to_go' has no effect without trainer.kl_in_reward"):
        TrainerConfig(kl_reward="to_go")
    with pytest.raises(ConfigError, match="trainer.kl_reward: 'sample' cannot apply to gae"):
        TrainerConfig(advantage="gae", kl_coef=0.1, kl_in_reward=True, kl_reward="sample")
    with pytest.raises(ConfigError, match="trainer.whiten_over: is samples, .* set trainer.whiten_over=tokens"):
        TrainerConfig(advantage="reinforce_pp_baseline", kl_coef=0.1, kl_in_reward=True, kl_reward="to_go")
    resolved = TrainerConfig(kl_coef=0.1, kl_in_reward=True).with_algorithm_defaults()
    assert resolved.kl_reward == "sample"
    assert TrainerConfig(advantage="gae", kl_coef=0.1, kl_in_reward=True).with_algorithm_defaults().kl_reward == "to_go"


# --- the proximal policy reaches a loss with several updates per batch ----------------------------------------------


SEEN: list = []


def test_prox_logprobs_reach_a_loss_of_ones_own_with_several_minibatches(model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_prox_loss.py").write_text(textwrap.dedent("""
        import tests.test_algorithm_options as t

        def loss(logprobs, inputs, cfg):
            t.SEEN.append((inputs.prox_logprobs, logprobs.detach().clone(), inputs.mask))
            return -(logprobs * inputs.advantages).where(inputs.mask, 0.0), {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "tests.test_algorithm_options", sys.modules[__name__])
    SEEN.clear()
    make(model_dir, policy_loss="my_prox_loss:loss", ppo_minibatches=2).optimizer_step(batch())
    assert len(SEEN) == 2 and all(prox is not None for prox, _, _ in SEEN)
    # the first minibatch runs at the proximal weights: its log-probs are the proximal ones
    prox, current, mask = SEEN[0]
    assert torch.allclose(prox[mask], current[mask], atol=1e-5)
    SEEN.clear()
    make(model_dir, policy_loss="my_prox_loss:loss").optimizer_step(batch())
    assert SEEN[0][0] is None  # one update per batch: no extra pass for a loss that does not ask


# --- GSPO around the proximal policy ------------------------------------------------------------------------------


def test_gspo_does_not_clip_a_stale_batch_before_its_first_update(model_dir):
    """Samples one version old (behaviour log-probs far from the current policy): around the behaviour policy
    GSPO's 3e-4 range clipped them all before any update; around the proximal policy the first update's ratio is
    1 and nothing clips, while the behaviour weight still corrects them."""
    trainer = make(model_dir, policy_loss="gspo")
    trainer._version = 1
    stats = trainer.optimizer_step(batch(behav=-6.0, version=0))
    assert stats["lag_mean"] == 1
    assert stats["clip_low_frac"] == 0 and stats["clip_high_frac"] == 0
    assert stats["seq_ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # the loss's own stats reach the metrics
    assert stats["behav_weight_mean"] > 1.5  # pi_prox / pi_behav: the staleness, corrected apart
    # the second update of a batch moves away from the proximal policy: there the clip acts
    two = make(model_dir, policy_loss="gspo", ppo_minibatches=2, samples_per_step=8, lr=0.1)
    moved = two.optimizer_step(batch() + [sample("c", [7, 8], [50, 51], 1.0), sample("c", [7, 8], [52], 0.0)])
    assert moved["clip_frac_first_minibatch"] == 0 and moved["clip_frac_later_minibatches"] > 0


def test_decoupled_ppo_caps_its_behaviour_weight_by_default(model_dir):
    """AReaL's default cap of 5 on pi_prox / pi_behav: a batch whose behaviour log-probs are far below the current
    policy's has its tokens dropped without setting anything; 0 turns the cap off."""
    default = make(model_dir, policy_loss="decoupled_ppo")
    assert default.cfg.behav_imp_weight_cap == 5.0
    assert default.optimizer_step(batch(behav=-9.0))["behav_capped_frac"] == 1.0
    uncapped = make(model_dir, policy_loss="decoupled_ppo", behav_imp_weight_cap=0.0)
    assert uncapped.optimizer_step(batch(behav=-9.0))["behav_capped_frac"] == 0.0


def test_token_sum_norm_divides_by_the_batch_actually_trained(model_dir):
    """The trainer contract lets a batch differ from samples_per_step: the loss and update are the same whatever
    samples_per_step says."""
    exact = make(model_dir, samples_per_step=4, aggregation="token_sum_norm").optimizer_step(batch())
    other = make(model_dir, samples_per_step=64, aggregation="token_sum_norm").optimizer_step(batch())
    assert other["loss"] == pytest.approx(exact["loss"], rel=1e-6)
    assert other["grad_norm"] == pytest.approx(exact["grad_norm"], rel=1e-5)


def test_every_statistic_a_loss_returns_is_logged(model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_stats_loss.py").write_text(textwrap.dedent("""
        import torch

        def loss(logprobs, inputs, cfg):
            n = inputs.mask.sum().float()
            return (-(logprobs * inputs.advantages)).where(inputs.mask, 0.0), {
                "my_tokens_seen": n / n, "my_count_max": n}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    stats = make(model_dir, policy_loss="my_stats_loss:loss", micro_batch_tokens=12).optimizer_step(batch())
    assert stats["my_tokens_seen"] == pytest.approx(1.0)  # token-weighted mean of a per-micro-batch 1
    assert stats["micro_batches"] > 1 and stats["my_count_max"] < stats["tokens"]  # a maximum, not a sum
    ppo = make(model_dir, policy_loss="ppo_clip").optimizer_step(batch())
    assert ppo["ratio_mean"] > 0 and ppo["ratio_max"] >= ppo["ratio_mean"]


# --- the KL in the reward, per sample or as each token's reward-to-go -----------------------------------------------


def test_kl_to_go_sums_each_sequences_later_tokens():
    kl = torch.tensor([9.0, 1, 2, 3, 4, 5, 6, 7])
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 0, 1, 2])  # sequence 1's tokens are not contiguous
    assert kl_to_go(kl, mask, seq).tolist() == [0, 3, 2, 13, 10, 0, 6, 7]


ADVANTAGES: list = []


@pytest.mark.parametrize("mode", ["sample", "to_go"])
def test_kl_in_the_reward_per_sample_or_per_token_to_go(model_dir, tmp_path, monkeypatch, mode):
    """`sample` charges every token of a sample the same (its summed KL): one advantage per sample. `to_go`
    (OpenRLHF's REINFORCE++) charges each token the KL from it to the end: a sample's advantages rise along it,
    and reinforce_pp_baseline whitens them over the batch's tokens afterwards."""
    (tmp_path / "my_adv_loss.py").write_text(textwrap.dedent("""
        import tests.test_algorithm_options as t

        def loss(logprobs, inputs, cfg):
            t.ADVANTAGES.append((inputs.advantages.clone(), inputs.mask.clone(), inputs.seq_ids.clone()))
            return (-(logprobs * inputs.advantages)).where(inputs.mask, 0.0), {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "tests.test_algorithm_options", sys.modules[__name__])
    ADVANTAGES.clear()
    trainer = make(model_dir, policy_loss="my_adv_loss:loss", advantage="reinforce_pp_baseline", whiten_over="tokens",
                   kl_coef=0.5, kl_in_reward=True, kl_reward=mode)
    with torch.no_grad():  # a reference far from the policy: every token has a KL
        for p in trainer.ref_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    stats = trainer.optimizer_step(batch())
    assert stats["kl_penalty_mean"] > 0
    adv, mask, seq = ADVANTAGES[0]
    per_seq = [adv[mask & (seq == s)] for s in seq[mask].unique()]
    if mode == "sample":
        assert all(torch.allclose(a, a[0].expand_as(a)) for a in per_seq)
    else:
        assert all((a[1:] > a[:-1]).all() for a in per_seq if len(a) > 1), per_seq
        assert float(adv[mask].mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(adv[mask].std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)


# --- reference resets keep the optimizer's state by default (ProRL v2) ----------------------------------------------


def test_a_reference_reset_keeps_the_optimizers_state_by_default(model_dir):
    trainer = make(model_dir, kl_coef=0.1, ref_reset_every=2, policy_loss="ppo_clip")
    assert trainer.cfg.ref_reset_optimizer is False
    stats = [trainer.optimizer_step(batch()) for _ in range(2)]
    assert stats[-1]["ref_reset"] == 1.0
    inner = trainer.optimizer
    while getattr(inner, "optimizer", inner) is not inner:
        inner = inner.optimizer
    moments = [s["exp_avg_sq"] for s in inner.state.values()]
    assert any(float(m.abs().sum()) > 0 for m in moments)


# --- presets ------------------------------------------------------------------------------------------------------


def test_presets_are_the_papers_and_load_onto_any_recipe():
    assert set(preset_names()) >= {"orz", "prorl_v2", "dapo", "areal", "pipelinerl", "gspo"}
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    for recipe in recipes:
        for name in preset_names():
            cfg = load_config(recipe, ["run_dir=/tmp/unused", f"preset={name}"])
            assert cfg.run_dir == "/tmp/unused"
    orz = load_config(ROOT / "recipes" / "orz_cpu.yaml", ["run_dir=/tmp/u", "preset=orz"])
    t = orz.trainer
    assert (t.policy_loss, t.advantage, t.clip_low, t.clip_high, t.lr, t.critic.lr, t.critic.updates) == (
        "ppo_clip", "gae", 0.2, 0.2, 1e-6, 5e-6, 12)
    assert t.critic.gamma == t.critic.lam == 1.0 and not orz.actor.dynamic_sampling
    assert orz.model.tiny_hidden_size == 128  # the recipe's own keys stay
    pipelinerl = load_config(ROOT / "recipes" / "orz_cpu.yaml", ["run_dir=/tmp/u", "preset=pipelinerl"]).trainer
    assert (pipelinerl.policy_loss, pipelinerl.is_cap, pipelinerl.advantage, pipelinerl.grad_clip) == (
        "reinforce_is", 1.02, "rloo", 0.3)
    assert pipelinerl.clip_low is None  # the recipe's PPO clip range went with its algorithm
    # overrides after the preset win
    assert load_config(ROOT / "recipes" / "tiny_cpu.yaml",
                       ["run_dir=/tmp/u", "preset=orz", "trainer.lr=1e-3"]).trainer.lr == 1e-3


def test_a_recipe_names_its_preset_and_its_own_keys_win(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preset: dapo\nrun_dir: /tmp/u\nmodel: {path: m}\ntrainer: {clip_high: 0.3}\n")
    t = load_config(recipe).trainer
    assert (t.policy_loss, t.aggregation, t.clip_high) == ("ppo_clip", "token_mean", 0.3)
    with pytest.raises(ConfigError, match="preset 'nope': no such preset; available: areal, dapo"):
        load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=/tmp/u", "preset=nope"])


def test_make_compare_presets_runs_each_papers_method_at_the_tiny_recipes_scale():
    """bench/algorithms.py --presets: every preset loads onto the tiny recipe with the recipe's scale kept (its
    learning rate, batch and group), its method (loss, estimator, clip, dynamic sampling) the preset's."""
    from bench.algorithms import PRESETS, preset_overrides

    assert set(PRESETS) == set(preset_names())
    for name in PRESETS:
        cfg = load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=/tmp/u", *preset_overrides(name)])
        paper = load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=/tmp/u", f"preset={name}"])
        assert (cfg.trainer.lr, cfg.trainer.samples_per_step, cfg.sampling.group_size) == (7e-4, 64, 8), name
        for key in ("policy_loss", "advantage", "clip_low", "clip_high", "aggregation"):
            assert getattr(cfg.trainer, key) == getattr(paper.trainer, key), (name, key)
        assert cfg.actor.dynamic_sampling == paper.actor.dynamic_sampling
    orz = load_config(ROOT / "recipes" / "tiny_cpu.yaml", ["run_dir=/tmp/u", *preset_overrides("orz")]).trainer
    assert orz.critic.lr == 5 * orz.lr and orz.critic.updates == 12  # ORZ's ratio and its updates
