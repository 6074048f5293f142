import math

import pytest
import torch
from torch import nn

from pipelinerl.rl import (
    ReferenceResetPolicy,
    aggregate,
    decoupled_ppo_loss,
    effective_sample_size,
    entropy_from_logits,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    logprobs_from_logits,
    ppo_clip_loss,
    reinforce_is_loss,
    reset_reference,
)

ln = math.log


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def close(a, b, **kw):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), **kw
    )


# --------------------------------------------------------------------------------------------- PPO clip


def test_ppo_clip_by_hand_values_grads_and_stats():
    # token 0: A=+1, ratio 1.5 -> min(1.5, 1.28) = 1.28 -> loss -1.28, clipped: grad 0
    # token 1: A=-1, ratio 0.5 -> min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped: grad 0
    # token 2: A=+1, ratio 0.5 -> min(0.5, 0.8) = 0.5 -> loss -0.5, grad d(-r*A)/dlogp = -r*A = -0.5
    # token 3: A=-1, ratio 1.5 -> min(-1.5, -1.28) = -1.5 -> loss 1.5, grad -r*A = +1.5 (unclipped side)
    # token 4: A=+2, ratio 1.0 -> loss -2, grad -2
    # token 5: masked out (ratio 10) -> loss 0, grad 0, ignored by stats
    old = t(-1.0, -1.0, -1.0, -1.0, -1.0, -1.0)
    ratio = t(1.5, 0.5, 0.5, 1.5, 1.0, 10.0)
    logp = (old + ratio.log()).requires_grad_()
    adv = t(1, -1, 1, -1, 2, 1)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, t(-1.28, 0.8, -0.5, 1.5, -2.0, 0.0))
    loss.sum().backward()
    close(logp.grad, t(0.0, 0.0, -0.5, 1.5, -2.0, 0.0))
    close(stats["clip_high_frac"], 1 / 5)  # token 0
    close(stats["clip_low_frac"], 1 / 5)  # token 1
    close(stats["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.5 + 1.0) / 5)
    close(stats["ratio_max"], 1.5)
    assert all(not v.requires_grad for v in stats.values())


def test_ppo_clip_float_mask_and_2d_layout():
    old = torch.zeros(2, 3)
    logp = torch.full((2, 3), ln(1.5)).requires_grad_()
    adv = torch.ones(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, old, adv, mask)
    close(loss, [[-1.28, -1.28, 0.0], [-1.28, 0.0, 0.0]])
    close(stats["clip_high_frac"], 1.0)


# --------------------------------------------------------------------------------------------- REINFORCE + IS


def test_reinforce_is_by_hand():
    # token 0: p=0.5, behav 0.25 -> w=2, A=+1: loss = -2*1*ln(0.5) = 1.386294, grad = -w*A = -2
    # token 1: p=0.8, behav 0.1 -> w=8 capped to 5, A=-1: loss = -5*(-1)*ln(0.8) = -1.115718, grad = +5
    # token 2: p=behav=0.4 -> w=1, A=0.5: loss = -0.5*ln(0.4) = 0.458145, grad = -0.5
    logp = t(ln(0.5), ln(0.8), ln(0.4)).requires_grad_()
    behav = t(ln(0.25), ln(0.1), ln(0.4))
    adv = t(1.0, -1.0, 0.5)
    loss, stats = reinforce_is_loss(logp, behav, adv, torch.ones(3, dtype=torch.bool), is_cap=5.0)
    close(loss, t(-2 * ln(0.5), 5 * ln(0.8), -0.5 * ln(0.4)))
    close(loss, t(1.386294, -1.115718, 0.458145), atol=1e-6, rtol=0)
    loss.sum().backward()
    close(logp.grad, t(-2.0, 5.0, -0.5))
    # stats on the uncapped weights [2, 8, 1]
    close(stats["is_weight_mean"], 11 / 3)
    close(stats["is_weight_max"], 8.0)
    close(stats["is_capped_frac"], 1 / 3)
    close(stats["ess"], 121 / (3 * 69))  # (2+8+1)^2 / (3 * (4+64+1))


def test_effective_sample_size():
    close(effective_sample_size(t(1, 3), torch.ones(2)), 0.8)  # 16 / (2 * 10)
    close(effective_sample_size(t(2, 2, 2), torch.ones(3)), 1.0)
    close(effective_sample_size(t(1, 3, 100), t(1, 1, 0)), 0.8)  # masked token ignored
    close(effective_sample_size(t(1, 3), torch.zeros(2)), 1.0)  # no tokens


# --------------------------------------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_by_hand_with_behaviour_cap():
    # token 0: ratio 1 (logp = prox), w = exp(prox - behav) = 2, A=1 -> loss = -2 * 1 = -2, grad -2
    # token 1: ratio 1.5 clipped to 1.28, w = 0.5, A=1 -> loss = -0.5 * 1.28 = -0.64, grad 0
    # token 2: ratio 1, w = 6 > cap 5 -> dropped: loss 0, grad 0 (without cap: -6)
    prox = t(ln(0.4), ln(0.4), ln(0.6))
    behav = t(ln(0.2), ln(0.8), ln(0.1))
    logp = (prox + t(0.0, ln(1.5), 0.0)).requires_grad_()
    adv = t(1.0, 1.0, 1.0)
    mask = torch.ones(3, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 0.28, behav_cap=5.0)
    close(loss, t(-2.0, -0.64, 0.0))
    loss.sum().backward()
    close(logp.grad, t(-2.0, 0.0, 0.0))
    close(stats["behav_weight_mean"], (2 + 0.5 + 6) / 3)
    close(stats["behav_weight_max"], 6.0)
    close(stats["behav_capped_frac"], 1 / 3)
    close(stats["clip_high_frac"], 1 / 3)

    uncapped, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 0.28, behav_cap=None)
    close(uncapped, t(-2.0, -0.64, -6.0))
    close(stats["behav_capped_frac"], 0.0)


def test_decoupled_ppo_on_policy_equals_ppo():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(10, generator=g, dtype=torch.float64)).requires_grad_()
    prox = logp.detach() + 0.3 * torch.randn(10, generator=g, dtype=torch.float64)
    adv = torch.randn(10, generator=g, dtype=torch.float64)
    mask = torch.rand(10, generator=g) > 0.2
    a, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask)
    b, _ = ppo_clip_loss(logp, prox, adv, mask)
    close(a, b)


# --------------------------------------------------------------------------------------------- GSPO


def test_gspo_by_hand_2d_layout():
    # clip 0.2/0.28 here to get readable numbers (GSPO's defaults are 3e-4/4e-4).
    # seq 0: log ratios [0.1, -0.1, (0.3 masked)] -> mean 0 -> s0 = 1; A = 2 -> per-token loss -2
    # seq 1: log ratios [ln1.5 + 0.2, ln1.5 - 0.2, (masked)] -> s1 = 1.5 > 1.28, A = 1
    #        -> clipped: per-token loss -1.28, grad 0
    # seq_mean: (mean(-2, -2) + mean(-1.28, -1.28)) / 2 = -1.64
    # grad: d/dlogp_t of seq 0 tokens = -A * s0 * (1/2 tokens) * (1/2 seqs) = -0.5
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = t(0.1, -0.1, 0.3, ln(1.5) + 0.2, ln(1.5) - 0.2, 0.7).view(2, 3).requires_grad_()
    adv = t(2, 2, 2, 1, 1, 1).view(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    loss, stats = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[-2.0, -2.0, 0.0], [-1.28, -1.28, 0.0]])
    total = aggregate(loss, mask, "seq_mean")
    close(total, -1.64)
    total.backward()
    close(logp.grad, [[-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    close(stats["seq_ratio_mean"], (1 + 1.5) / 2)
    close(stats["seq_ratio_max"], 1.5)
    close(stats["clip_high_frac"], 0.5)


def test_gspo_gradient_matches_sequence_level_objective():
    # Unclipped regime: grad of GSPO-token + seq_mean == grad of -mean_i s_i(theta) * A_i, where
    # s_i(theta) = exp(mean_t (logp_t - old_t)) is differentiated directly.
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp0 = old + 1e-3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    seq_adv = t(1.0, -0.5, 2.0)
    adv = seq_adv[:, None].expand(3, 5)
    a = logp0.clone().requires_grad_()
    loss, _ = gspo_loss(a, old, adv, mask, clip_low=0.1, clip_high=0.1)
    aggregate(loss, mask, "seq_mean").backward()
    b = logp0.clone().requires_grad_()
    s = torch.exp(((b - old) * mask).sum(1) / mask.sum(1))
    (-(s * seq_adv).mean()).backward()
    close(a.grad, b.grad)


def test_gspo_packed_layout_matches_2d_and_default_tiny_clip():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    logp = old + 5e-4  # s = exp(5e-4) = 1.0005 > 1 + 4e-4: clipped for A > 0 with the default ranges
    adv = torch.ones(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss2d, stats = gspo_loss(logp, old, adv, mask)
    close(loss2d, torch.full((2, 4), -(1 + 4e-4), dtype=torch.float64))
    close(stats["clip_high_frac"], 1.0)
    seq_ids = torch.tensor([5, 5, 5, 5, 9, 9, 9, 9])  # any labels
    loss1d, _ = gspo_loss(
        logp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1), seq_ids=seq_ids
    )
    close(loss1d, loss2d.reshape(-1))
    with pytest.raises(ValueError, match="seq_ids"):
        gspo_loss(logp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1))


# --------------------------------------------------------------------------------------------- aggregation


def test_aggregate_modes_by_hand():
    loss = t(1, 2, 3, 4, 5, 6).view(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    close(aggregate(loss, mask, "token_sum_norm", num_sequences=4), (1 + 2 + 4) / 4)
    close(aggregate(loss, mask, "token_mean"), 7 / 3)
    close(aggregate(loss, mask, "token_mean", num_tokens=14), 0.5)
    close(aggregate(loss, mask, "seq_mean"), (1.5 + 4) / 2)
    close(aggregate(loss, mask, "seq_mean", num_sequences=4), (1.5 + 4) / 4)
    # packed layout, same numbers
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    close(aggregate(loss.view(-1), mask.view(-1), "seq_mean", seq_ids=seq_ids), 2.75)
    # a fully masked sequence is not counted by seq_mean
    close(aggregate(loss, torch.tensor([[1, 1, 0], [0, 0, 0]]), "seq_mean"), 1.5)


def test_aggregate_ignores_non_finite_masked_values_and_errors():
    loss = t(1.0, float("inf"), float("nan"))
    mask = t(1, 0, 0)
    close(aggregate(loss, mask, "token_mean"), 1.0)
    with pytest.raises(ValueError, match="num_sequences"):
        aggregate(loss, mask, "token_sum_norm")
    with pytest.raises(ValueError, match="unknown"):
        aggregate(loss, mask, "bogus")


def test_token_sum_norm_is_additive_over_micro_batches():
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    whole = aggregate(loss, mask, "token_sum_norm", num_sequences=6)
    parts = aggregate(loss[:2], mask[:2], "token_sum_norm", num_sequences=6) + aggregate(
        loss[2:], mask[2:], "token_sum_norm", num_sequences=6
    )
    close(whole, parts, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------- logits helpers


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(4)), ln(4))
    # logits [0, ln 3] -> p = [1/4, 3/4] -> H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    close(entropy_from_logits(t(0.0, ln(3))), 0.562335, atol=1e-6, rtol=0)
    close(entropy_from_logits(t(100.0, 0.0, 0.0)), 0.0, atol=1e-40, rtol=0)
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(2, 3, 7, generator=g)
    p = logits.softmax(-1)
    close(entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)


def test_logprobs_from_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 10, generator=g)
    labels = torch.randint(0, 10, (3, 4), generator=g)
    expect = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    close(logprobs_from_logits(logits, labels, temperature=0.7), expect, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # logp = ln 0.5, ref = ln 0.25: d = ln 2
    # k1 = ln2 = 0.693147; k2 = (ln2)^2 / 2 = 0.240227; k3 = exp(-ln2) + ln2 - 1 = 0.193147
    logp, ref = t(ln(0.5)), t(ln(0.25))
    close(kl_estimate(logp, ref, "k1"), [0.693147], atol=1e-6, rtol=0)
    close(kl_estimate(logp, ref, "k2"), [0.240227], atol=1e-6, rtol=0)
    close(kl_estimate(logp, ref, "k3"), [0.193147], atol=1e-6, rtol=0)
    for kind in ("k1", "k2", "k3"):
        close(kl_estimate(ref, ref, kind), [0.0])
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_k1_k3_are_unbiased_and_k3_nonnegative():
    # E_{x~p}[k1] = E_{x~p}[k3] = KL(p || q), computed exactly over a categorical support
    p = t(0.1, 0.2, 0.3, 0.4)
    q = t(0.4, 0.3, 0.2, 0.1)
    kl = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):
        close((p * kl_estimate(p.log(), q.log(), kind)).sum(), kl)
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()


def test_reference_reset_policy():
    every3 = ReferenceResetPolicy(every_n_steps=3)
    assert [every3.should_reset(s, 0.0) for s in range(1, 8)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
    ]
    both = ReferenceResetPolicy(every_n_steps=3, kl_threshold=0.1)
    got = [
        both.should_reset(s, kl) for s, kl in [(1, 0.0), (2, 0.05), (3, 0.0), (4, 0.5), (5, 0.0), (6, 0.0)]
    ]
    # periodic at 3; KL spike at 4; the period then restarts from 4, so 6 is not a reset (7 would be)
    assert got == [False, False, True, True, False, False]
    assert both.should_reset(7, torch.tensor(0.0))
    never = ReferenceResetPolicy()
    assert not any(never.should_reset(s, 1e9) for s in range(10))


def test_reset_reference_copies_in_place_and_leaves_optimizer_alone():
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    ref = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double().requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=0.1)
    policy(torch.randn(5, 3)).sum().backward()
    opt.step()
    state_before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    ref_ptrs = [p.data_ptr() for p in ref.parameters()]

    reset_reference(ref, policy)

    for (_, rp), (_, pp) in zip(ref.named_parameters(), policy.named_parameters(), strict=True):
        close(rp, pp.double())
        assert rp.dtype == torch.float64 and not rp.requires_grad
    assert [p.data_ptr() for p in ref.parameters()] == ref_ptrs
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, state_before[k][n])
    with pytest.raises(ValueError):
        reset_reference(nn.Linear(3, 4), policy)


# --------------------------------------------------------------------------------------------- toy sanity


def _train_toy_bandit(loss_name: str, steps: int = 200) -> float:
    """4-armed bandit, reward 1 for action 2, policy = softmax(theta); returns final P(action 2).

    Samples come from the policy one step stale (as with in-flight weight updates), so the importance
    weights are not identically 1.
    """
    g = torch.Generator().manual_seed(0)
    theta = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=0.5)
    stale = theta.detach().clone()
    group = torch.zeros(16, dtype=torch.long)
    for _ in range(steps):
        behav_all = torch.log_softmax(stale, -1)
        actions = torch.multinomial(behav_all.exp(), 16, replacement=True, generator=g)
        rewards = (actions == 2).float()
        adv = grpo_advantages(rewards, group)
        logp = torch.log_softmax(theta, -1)[actions]
        behav = behav_all[actions]
        mask = torch.ones(16, dtype=torch.bool)
        if loss_name == "reinforce_is":
            loss, _ = reinforce_is_loss(logp, behav, adv, mask)
        elif loss_name == "ppo":
            loss, _ = ppo_clip_loss(logp, behav, adv, mask)
        elif loss_name == "decoupled":
            loss, _ = decoupled_ppo_loss(logp, logp.detach(), behav, adv, mask, behav_cap=5.0)
        elif loss_name == "gspo":
            loss, _ = gspo_loss(logp, behav, adv, mask, seq_ids=torch.arange(16))
        stale = theta.detach().clone()
        opt.zero_grad()
        aggregate(loss, mask, "token_mean").backward()
        opt.step()
    return torch.softmax(theta.detach(), -1)[2].item()


@pytest.mark.parametrize("loss_name", ["reinforce_is", "ppo", "decoupled", "gspo"])
def test_toy_bandit_learns_rewarded_action(loss_name):
    assert _train_toy_bandit(loss_name) > 0.9


def test_k3_is_clamped_where_its_exponential_would_overflow():
    """A sampled token the reference finds e^100 times likelier than the policy: unclamped, exp(100) is inf in
    float32 and the step would be skipped; clamped, the estimate and its gradient are finite and bounded."""
    from pipelinerl.rl.kl import K3_MAX

    logp = torch.tensor([-100.0, -1.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -1.0, -100.0])
    kl = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(kl).all() and (kl <= K3_MAX).all() and kl[1] == 0
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_dual_clip_caps_negative_advantage_loss_and_its_gradient():
    """Where A < 0 the PPO loss -min(r A, clip(r) A) = r |A| grows without bound in the ratio; dual-clip caps it
    at clip_ratio_c |A| (gradient 0 beyond). Positive advantages and moderate ratios are untouched."""
    logp = torch.tensor([0.0, 2.0, 2.0, 0.5], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    r = torch.exp(logp.detach())
    # token 1: ratio e^2 = 7.4 > 3 -> capped at 3 * 1; token 2: A > 0, clipped at 1.2; token 3: ratio 1.65 < 3
    assert loss.tolist() == pytest.approx([1.0, 3.0, -1.2, float(2 * r[3])], rel=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([1.0, 0.0, 0.0, float(2 * r[3])], rel=1e-6)
    assert float(stats["dual_clip_frac"]) == pytest.approx(0.25)
    plain, _ = ppo_clip_loss(logp.detach(), old, adv, mask, 0.2, 0.2)
    assert float(plain[1]) == pytest.approx(float(r[1]))
    # decoupled PPO passes it on
    d, d_stats = decoupled_ppo_loss(logp.detach(), old, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    assert float(d[1]) == pytest.approx(3.0) and float(d_stats["dual_clip_frac"]) == pytest.approx(0.25)


def test_decoupled_ppo_sequence_level_ratio_is_the_geometric_mean():
    logp = torch.tensor([0.2, 0.4, -0.3, 0.0])
    prox = torch.zeros(4)
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.ones(4)
    mask = torch.tensor([True, True, True, False])
    _, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, 10.0, 10.0, seq_ids=seq,
                                  importance_sampling_level="sequence")
    # sequence 0: exp(mean(0.2, 0.4)) = e^0.3 on both tokens; sequence 1: e^-0.3 on its one trained token
    expected = (2 * math.exp(0.3) + math.exp(-0.3)) / 3
    assert float(stats["ratio_mean"]) == pytest.approx(expected, rel=1e-6)


def test_reference_reset_on_stagnating_validation():
    policy = ReferenceResetPolicy(patience=2)
    for score in (0.3, 0.5, 0.5):
        policy.note_score(score)
    assert not policy.should_reset(1)
    policy.note_score(0.4)
    assert policy.should_reset(2) and not policy.should_reset(3)  # a reset starts the patience again
    assert ReferenceResetPolicy(patience=1).should_reset(1, stagnating=True)  # the main process's verdict
