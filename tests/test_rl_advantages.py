import math

import pytest
import torch

from pipelinerl.rl import (
    dr_grpo_advantages,
    group_all_equal,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_grpo_single_group_by_hand():
    # rewards [1,0,0,1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1]
    adv = grpo_advantages(t(1, 0, 0, 1), ids(0, 0, 0, 0), eps=0.0)
    torch.testing.assert_close(adv, t(1, -1, -1, 1))
    # default eps=1e-6: 0.5 / (0.5 + 1e-6)
    adv = grpo_advantages(t(1, 0, 0, 1), ids(0, 0, 0, 0))
    torch.testing.assert_close(adv, t(1, -1, -1, 1) * (0.5 / 0.500001))


def test_grpo_unbiased_std():
    # Bessel: var = 4 * 0.25 / 3 = 1/3, std = 0.57735 -> 0.5 / 0.57735 = sqrt(3) / 2
    adv = grpo_advantages(t(1, 0, 0, 1), ids(0, 0, 0, 0), eps=0.0, unbiased=True)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, t(h, -h, -h, h))


def test_grpo_ragged_groups_arbitrary_ids_and_constant_groups():
    # group 7: [1,0,0,1] -> [1,-1,-1,1]; group 3: [2,0] (mean 1, std 1) -> [1,-1];
    # group 5: [0.3]*3 constant -> exactly 0 (no NaN, no rounding noise); group 9: singleton -> 0
    rewards = t(1, 2, 0.3, 0, 0.3, 4, 0, 0, 0.3, 1)
    groups = ids(7, 3, 5, 7, 5, 9, 3, 7, 5, 7)
    adv = grpo_advantages(rewards, groups, eps=0.0)
    torch.testing.assert_close(adv, t(1, 1, 0, -1, 0, 0, -1, -1, 0, 1))
    assert torch.isfinite(adv).all()
    const = adv[groups == 5]
    assert (const == 0).all()


def test_grpo_unbiased_singleton_is_zero_not_nan():
    adv = grpo_advantages(t(1.0, 0.0, 5.0), ids(0, 0, 1), unbiased=True)
    assert torch.isfinite(adv).all()
    assert adv[2] == 0


def test_dr_grpo_by_hand():
    # [1,0,0,1] -> r - 0.5; [1,0,0] -> r - 1/3; constant [1,1] -> 0
    adv = dr_grpo_advantages(t(1, 0, 0, 1, 1, 0, 0, 1, 1), ids(0, 0, 0, 0, 1, 1, 1, 2, 2))
    torch.testing.assert_close(adv, t(0.5, -0.5, -0.5, 0.5, 2 / 3, -1 / 3, -1 / 3, 0, 0))


def test_rloo_by_hand():
    # [1,0,0,1]: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - (1+0+1)/3 = -2/3
    # [1,0,0]:  r=1 -> 1 - 0 = 1;            r=0 -> 0 - (1+0)/2 = -0.5
    # singleton [3] -> no leave-one-out baseline -> 0
    adv = rloo_advantages(t(1, 0, 0, 1, 1, 0, 0, 3), ids(0, 0, 0, 0, 1, 1, 1, 2))
    torch.testing.assert_close(adv, t(2 / 3, -2 / 3, -2 / 3, 2 / 3, 1, -0.5, -0.5, 0))


def test_rloo_equals_scaled_dr_grpo():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g)
    groups = ids(*([0] * 5 + [1] * 4 + [2] * 3))
    n = torch.bincount(groups).float()[groups]
    torch.testing.assert_close(
        rloo_advantages(rewards, groups), n / (n - 1) * dr_grpo_advantages(rewards, groups)
    )


def test_reinforce_pp_baseline_by_hand():
    # centred: g0 [1,0,0,1] -> [.5,-.5,-.5,.5]; g1 [1,0] -> [.5,-.5]; g2 [1,1] -> [0,0]
    # batch: six values of +-0.5 and two 0 -> mean 0, var = 6 * 0.25 / 8 = 0.1875, std = sqrt(3)/4
    # A = +-0.5 / (sqrt(3)/4) = +-2/sqrt(3) (GRPO would give +-1 in both groups)
    adv = reinforce_pp_baseline_advantages(t(1, 0, 0, 1, 1, 0, 1, 1), ids(0, 0, 0, 0, 1, 1, 2, 2), eps=0.0)
    a = 2 / math.sqrt(3)
    torch.testing.assert_close(adv, t(a, -a, -a, a, a, -a, 0, 0))


def test_reinforce_pp_baseline_all_constant_batch_is_zero():
    adv = reinforce_pp_baseline_advantages(t(1, 1, 0, 0), ids(0, 0, 1, 1))
    assert (adv == 0).all()


def test_group_all_equal():
    # group 0: [1,0] mixed; group 1: [0,1] mixed; group 2: [1,1] constant
    rewards = t(1, 1, 1, 0, 1, 0)
    groups = ids(2, 0, 2, 1, 1, 0)
    assert group_all_equal(rewards, groups).tolist() == [False, False, True]
    assert group_all_equal(rewards, groups, per_sample=True).tolist() == [
        True,
        False,
        True,
        False,
        False,
        False,
    ]


def test_input_validation():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError):
        grpo_advantages(torch.zeros(2), torch.zeros(2))


def test_reinforce_pp_baseline_token_level_whitening():
    """Whitened over tokens (OpenRLHF, verl): every sample's centred reward counts once per token, so the
    token-weighted mean is 0 and the token-weighted std 1; over samples, the plain mean and std are."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 1])
    tokens = torch.tensor([10.0, 2.0, 3.0, 7.0, 1.0])
    adv = reinforce_pp_baseline_advantages(rewards, groups, eps=0.0, token_counts=tokens)
    mean = (tokens * adv).sum() / tokens.sum()
    std = ((tokens * (adv - mean) ** 2).sum() / tokens.sum()).sqrt()
    assert float(mean) == pytest.approx(0, abs=1e-6) and float(std) == pytest.approx(1, rel=1e-5)
    per_sample = reinforce_pp_baseline_advantages(rewards, groups, eps=0.0)
    assert float(per_sample.mean()) == pytest.approx(0, abs=1e-6)
    assert float(per_sample.std(unbiased=False)) == pytest.approx(1, rel=1e-5)
    assert not torch.allclose(adv, per_sample)
    # the ordering within a group is the same: only the batch-level shift and scale differ
    assert bool(adv[0] > adv[1]) and bool(adv[2] > adv[4] > adv[3])
