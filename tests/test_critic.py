"""PPO with a critic (`trainer.advantage: gae`, ORZ's method): GAE and the clipped value loss as formulas, then the
critic in the real trainer: its loss falls and its values explain the returns, value clipping bounds its moves, the
policy moves towards the rewarded answer, KL in the reward reaches the per-token advantages, and a checkpoint
resumes the critic exactly. The tiny recipe learning with a critic is in test_tiny_recipe.py."""

import dataclasses

import pytest
import torch

from pipelinerl.config import ConfigError, CriticConfig, TrainerConfig
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.rl.values import gae_advantages, value_loss
from pipelinerl.samples import Sample
from pipelinerl.trainer import Trainer
from pipelinerl.trainer.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint

# --- the formulas ------------------------------------------------------------------------------------------------


def gae_by_hand(rewards, values, mask, seq_ids, gamma, lam):
    """The textbook recursion, one sequence and one action at a time."""
    adv, ret = torch.zeros(len(rewards)), torch.zeros(len(rewards))
    for s in seq_ids.unique():
        actions = [t for t in range(len(rewards)) if seq_ids[t] == s and mask[t]]
        next_value = next_adv = 0.0
        for t in reversed(actions):
            next_adv = rewards[t] + gamma * next_value - values[t] + gamma * lam * next_adv
            adv[t], ret[t], next_value = next_adv, next_adv + values[t], values[t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.95), (0.0, 1.0)])
def test_gae_matches_the_recursion_over_each_sequences_actions(gamma, lam):
    """Packed sequences of different lengths; the mask has holes inside sequences (prompt tokens, tool output):
    those are not time steps, and V after a sequence's last action is 0."""
    g = torch.Generator().manual_seed(0)
    seq_ids = torch.tensor([0] * 5 + [1] * 9 + [2] * 4 + [3] * 3)
    mask = torch.rand(len(seq_ids), generator=g) > 0.3
    mask[18:] = False  # a sequence with no action at all (left out by overlong filtering)
    rewards, values = torch.randn(len(seq_ids), generator=g), torch.randn(len(seq_ids), generator=g)
    adv, ret = gae_advantages(rewards, values, mask, seq_ids, gamma, lam)
    want_adv, want_ret = gae_by_hand(rewards, values, mask, seq_ids, gamma, lam)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    """ORZ's setting: a reward only at the end makes every action's return that reward, its advantage R - V."""
    seq_ids, mask = torch.zeros(4, dtype=torch.long), torch.tensor([False, True, True, True])
    values = torch.tensor([0.0, 0.2, 0.5, 0.9])
    adv, ret = gae_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), values, mask, seq_ids)
    torch.testing.assert_close(ret, torch.tensor([0.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.8, 0.5, 0.1]))


def test_value_loss_clips_moves_away_from_the_old_values():
    old, returns = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, -1.0])
    values = torch.tensor([0.5, 0.1, 0.5])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    # 1st: moved 0.5 towards the return, clipped to 0.2: the larger (clipped) error counts; 2nd: within the clip;
    # 3rd: moved away from the return: the unclipped (larger) error counts
    torch.testing.assert_close(loss, torch.tensor([0.5 * 0.8 ** 2, 0.5 * 0.9 ** 2, 0.5 * 1.5 ** 2]))
    assert clipped.tolist() == [True, False, False]
    unclipped, _ = value_loss(values, old, returns, clip=None)
    torch.testing.assert_close(unclipped, 0.5 * (values - returns).square())


# --- in the trainer -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("critic_model"), hidden_size=32, num_layers=1, seed=3,
                            initializer_range=0.1)


def sample(group, prompt, output, reward, behav=-2.0):
    return Sample(group_id=group, prompt_token_ids=prompt, output_token_ids=output,
                  behav_logprobs=[behav] * len(output), versions=[0] * len(output), finish_reason="stop",
                  reward=reward)


def batch():
    return [sample("a", [5, 6, 7], [10, 11, 12], 1.0), sample("a", [5, 6, 7], [20, 21], 0.0),
            sample("b", [8, 9], [30, 31], 1.0), sample("b", [8, 9], [40, 41, 42, 43], 0.0)]


def make(model_dir, critic=None, **overrides):
    cfg = dict(lr=1e-2, samples_per_step=4, micro_batch_tokens=16, grad_clip=1.0, advantage="gae",
               critic=CriticConfig(**{"lr": 1e-2, "updates": 2, **(critic or {})}))
    cfg.update(overrides)
    return Trainer(str(model_dir), TrainerConfig(**cfg), seed=0)


def test_the_critics_loss_falls_and_its_values_explain_the_returns(model_dir):
    trainer = make(model_dir)
    assert trainer.critic is not None
    stats = [trainer.optimizer_step(batch()) for _ in range(30)]
    first, last = stats[0], stats[-1]
    # the head starts at zero: V = 0 everywhere, so the first advantages are the whitened returns
    assert first["critic_explained_var"] == pytest.approx(0.0, abs=1e-6)
    assert last["critic_loss"] < 0.4 * first["critic_loss"], (first["critic_loss"], last["critic_loss"])
    assert last["critic_explained_var"] > 0.3, last["critic_explained_var"]
    assert last["critic_updates_applied"] == 2 and last["updates_applied"] == 1 and trainer.version == 30
    assert trainer.critic.optimizer.param_groups[0]["lr"] == 1e-2  # its own learning rate


def test_without_a_critic_estimator_there_is_no_critic(model_dir):
    trainer = Trainer(str(model_dir), TrainerConfig(lr=1e-2, samples_per_step=4, micro_batch_tokens=16), seed=0)
    assert trainer.critic is None and "critic_loss" not in trainer.optimizer_step(batch())
    # and a critic configured for an estimator that has none is refused, naming the key and who reads it
    with pytest.raises(ConfigError, match=r"trainer\.critic: set, but .* trainer\.advantage grpo .* read by gae"):
        TrainerConfig(advantage="grpo", critic=CriticConfig(lr=1e-4))


def test_value_clipping_bounds_the_critics_moves(model_dir):
    """A critic learning rate far too high moves the values by more than value_clip within a step: the later
    updates of a step find clipped tokens; without the clip nothing is counted as clipped."""
    clipped = make(model_dir, critic={"lr": 0.3, "updates": 4, "value_clip": 0.01}, micro_batch_tokens=8)
    stats = [clipped.optimizer_step(batch()) for _ in range(3)]
    assert max(s["critic_value_clip_frac"] for s in stats) > 0.2, [s["critic_value_clip_frac"] for s in stats]
    free = make(model_dir, critic={"lr": 0.3, "updates": 4, "value_clip": None}, micro_batch_tokens=8)
    assert all(free.optimizer_step(batch())["critic_value_clip_frac"] == 0 for _ in range(3))


def seq_logprob(trainer, prompt, output):
    from pipelinerl.rl.packing import build_packed_batch
    from pipelinerl.trainer.forward import packed_logprobs
    p = build_packed_batch([prompt + output])
    with torch.no_grad():
        lp = packed_logprobs(trainer.model, p)[len(prompt):]
    return float(lp.sum()), lp.tolist()


def test_ppo_with_a_critic_moves_the_policy_towards_the_rewarded_answer(model_dir):
    trainer = make(model_dir, lr=1e-2, policy_loss="ppo_clip")
    prompt, good, bad = [5, 6, 7], [10, 11], [20, 21]
    good_0, good_lp = seq_logprob(trainer, prompt, good)
    bad_0, bad_lp = seq_logprob(trainer, prompt, bad)
    on_policy = [sample("g", prompt, good, 1.0), sample("g", prompt, bad, 0.0)] * 2
    for s, lp in zip(on_policy, [good_lp, bad_lp] * 2):
        s.behav_logprobs = lp
    for _ in range(60):
        stats = trainer.optimizer_step(on_policy)
    good_1, bad_1 = seq_logprob(trainer, prompt, good)[0], seq_logprob(trainer, prompt, bad)[0]
    assert good_1 > good_0 + 0.2 and bad_1 < bad_0 - 0.2, (good_0, good_1, bad_0, bad_1)
    assert stats["skipped"] == 0


def test_kl_in_the_reward_reaches_every_token_through_gae(model_dir):
    """With the KL penalty in the reward, GAE charges it per token: the returns of a far-from-reference answer fall
    by the penalty still to come, so they differ from the plain returns (and are below them)."""
    plain = make(model_dir, kl_coef=0.5, kl_in_reward=True, critic={"whiten_advantages": False})
    charged = plain.optimizer_step(batch())
    free = make(model_dir, critic={"whiten_advantages": False}).optimizer_step(batch())
    assert charged["kl_penalty_mean"] > 0
    assert charged["critic_returns_mean"] < free["critic_returns_mean"] - 1e-3


def test_a_checkpoint_resumes_the_critic_exactly(model_dir, tmp_path):
    straight = make(model_dir)
    for _ in range(3):
        straight.optimizer_step(batch())
    expected = straight.optimizer_step(batch())

    first = make(model_dir)
    for _ in range(3):
        first.optimizer_step(batch())
    save_checkpoint(first, checkpoint_dir(tmp_path, 3))
    resumed = make(model_dir)
    load_checkpoint(resumed, checkpoint_dir(tmp_path, 3))
    got = resumed.optimizer_step(batch())
    for key in ("critic_loss", "critic_explained_var", "critic_grad_norm", "loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


# --- issue 48: the critic sees only the past; shuffled updates, its warm-up, the policy frozen while it fits -------


def random_head(trainer):
    """The critic's head is zero-initialised (V = 0 everywhere, trivially causal): give it weights."""
    head = trainer.accelerator.unwrap_model(trainer.critic.model).score
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 1.0)


@pytest.mark.parametrize("attention", ["auto", "mask", "padded"])
def test_the_critic_sees_only_the_past_in_every_layout(model_dir, attention):
    """V at token t is the value of the state before it: changing token t leaves V_t unchanged, changing token t-1
    changes it; and a packed row's values equal each sequence's values alone, in every layout the trainer uses."""
    from pipelinerl.rl.packing import build_packed_batch

    trainer = make(model_dir)
    random_head(trainer)
    critic = trainer.critic
    base = [5, 6, 7, 10, 11, 12, 13]
    t = 5
    with torch.no_grad():
        v = critic.values(build_packed_batch([base]), attention)
        changed_t = critic.values(build_packed_batch([base[:t] + [40] + base[t + 1:]]), attention)
        changed_before = critic.values(build_packed_batch([base[:t - 1] + [40] + base[t:]]), attention)
        assert changed_t[t] == pytest.approx(float(v[t]), abs=1e-6)
        assert torch.allclose(changed_t[:t + 1], v[:t + 1], atol=1e-6)
        assert abs(float(changed_before[t]) - float(v[t])) > 1e-4
        others = [[8, 9, 30, 31], [5, 6, 20, 21, 22]]
        packed = critic.values(build_packed_batch([base, *others]), attention)
        alone = torch.cat([critic.values(build_packed_batch([s]), attention) for s in [base, *others]])
        assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()


def test_critic_updates_take_the_batch_in_a_seeded_shuffled_order(model_dir):
    """ORZ shuffles its critic's mini-batches: the parts differ from the packing order, and are the same on a
    rerun with the same seed (a resumed run updates as the straight one)."""
    trainer = make(model_dir, critic={"updates": 4})
    from pipelinerl.trainer.batch import build_step

    step = build_step(batch(), 16, 0, 1, trainer.accelerator.device, 1, False)
    mbs = [mb for m in step.minibatches for mb in m.micro_batches]
    trainer.critic.add_values(mbs)
    trainer._set_advantages(step, mbs, 0.0)

    def order(step_index, shuffle=True):
        trainer.critic.critic_cfg = dataclasses.replace(trainer.critic.critic_cfg, shuffle=shuffle)
        groups = trainer.critic._update_groups(mbs, step_index)
        return [tuple(g[0].packed.input_ids[0].tolist()) for g in groups]

    contiguous = order(0, shuffle=False)
    shuffled = [order(i) for i in range(6)]
    assert shuffled[0] == order(0)  # seeded: the same step, the same order
    assert any(s != contiguous for s in shuffled) and len({tuple(s) for s in shuffled}) > 1


def test_the_critics_learning_rate_warms_up_then_stays(model_dir):
    """Over its optimizer updates, as ORZ steps its critic's scheduler: 2 updates a step, 8 of warm-up."""
    trainer = make(model_dir, critic={"lr": 1e-2, "warmup_updates": 8})
    lrs = [trainer.optimizer_step(batch())["critic_lr"] for _ in range(6)]  # each step's last update
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])


def test_the_policy_stays_frozen_while_the_critic_fits(model_dir):
    """critic.policy_frozen_steps (verl's critic_warmup): the first steps train the critic only; the policy's
    weights do not move, the versions still count (the engines sample the same weights), nothing is 'skipped'."""
    trainer = make(model_dir, policy_loss="ppo_clip", critic={"policy_frozen_steps": 3})
    before = {n: t.clone() for n, t in trainer.full_parameters()}
    stats = [trainer.optimizer_step(batch()) for _ in range(3)]
    frozen = {n: t.clone() for n, t in trainer.full_parameters()}
    assert all(torch.equal(before[n], frozen[n]) for n in before)
    assert [s["policy_frozen"] for s in stats] == [1.0, 1.0, 1.0] and trainer.version == 3
    assert all(s["skipped"] == 0 and s["critic_updates_applied"] == 2 for s in stats)
    assert stats[-1]["critic_loss"] < stats[0]["critic_loss"]
    moved = trainer.optimizer_step(batch())
    assert moved["policy_frozen"] == 0 and moved["updates_applied"] == 1
    assert any(not torch.equal(frozen[n], t) for n, t in trainer.full_parameters())
