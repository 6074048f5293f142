"""Group-relative advantage estimators for outcome-reward RL.

API convention (the same for every function here): ``rewards`` is a 1-D float tensor ``[N]`` with one scalar
reward per sampled completion, and ``group_ids`` is a 1-D integer tensor ``[N]`` saying which prompt group
each completion belongs to. Group ids are arbitrary labels (they need not be contiguous, sorted or start at
0) and groups may have different sizes, which happens after dynamic-sampling filtering or when some rollouts
failed. Every function returns one advantage per completion, shape ``[N]``; the trainer broadcasts it over
the completion's tokens.

A group whose rewards are all equal carries no learning signal under any group baseline, so all estimators
return exactly 0 for it (rather than a value polluted by float rounding of the mean, or NaN from a 0/0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pipelinerl.rl.registry import AdvantageInputs, register_advantage

if TYPE_CHECKING:
    from pipelinerl.config import TrainerConfig


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.ndim != 1 or group_ids.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D tensors of the same length, got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not torch.is_floating_point(rewards):
        raise TypeError(f"rewards must be a float tensor, got {rewards.dtype}")
    if torch.is_floating_point(group_ids):
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group labels to dense indices 0..G-1 (ordered by ascending label)."""
    _, inverse = torch.unique(group_ids, sorted=True, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    return inverse, num_groups


def _group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return (inverse index, per-group count, per-group mean, per-group all-equal flag)."""
    _check(rewards, group_ids)
    inverse, num_groups = _group_index(group_ids)
    count = torch.bincount(inverse, minlength=num_groups).to(rewards.dtype)
    mean = _group_sum(rewards, inverse, num_groups) / count.clamp(min=1)
    empty = torch.empty(num_groups, dtype=rewards.dtype, device=rewards.device)
    gmax = empty.scatter_reduce(0, inverse, rewards, reduce="amax", include_self=False)
    gmin = empty.clone().scatter_reduce(0, inverse, rewards, reduce="amin", include_self=False)
    return inverse, count, mean, gmax == gmin


def group_all_equal(rewards: Tensor, group_ids: Tensor, per_sample: bool = False) -> Tensor:
    """Whether every reward in a group is the same (e.g. all correct or all wrong).

    Dynamic sampling (DAPO) drops such groups because every group-baseline advantage is zero for them, so they
    only dilute the batch. Returns a bool tensor with one entry per group, ordered by ascending group id (the
    order of ``torch.unique(group_ids)``), or, with ``per_sample=True``, one entry per completion ``[N]``
    (handy as a keep-mask: ``rewards[~group_all_equal(r, g, per_sample=True)]``).
    """
    inverse, _, _, constant = _group_stats(rewards, group_ids)
    return constant[inverse] if per_sample else constant


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, unbiased: bool = False) -> Tensor:
    """GRPO advantage: ``A_i = (r_i - mean_g) / (std_g + eps)`` within each group g.

    ``std_g`` is the population standard deviation (divide by n) unless ``unbiased=True`` (divide by n - 1, as
    ``torch.std`` does; a group of one then has std 0). Constant groups get exactly 0.
    """
    inverse, count, mean, constant = _group_stats(rewards, group_ids)
    centered = rewards - mean[inverse]
    denom = (count - 1 if unbiased else count).clamp(min=1)
    std = (_group_sum(centered.square(), inverse, count.numel()) / denom).sqrt()
    adv = centered / (std[inverse] + eps)
    return torch.where(constant[inverse], torch.zeros_like(adv), adv)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO advantage: ``A_i = r_i - mean_g``.

    Dropping GRPO's division by the group std removes its question-difficulty bias (groups with small reward
    variance, i.e. nearly always / never solved, are otherwise up-weighted).
    """
    inverse, _, mean, constant = _group_stats(rewards, group_ids)
    adv = rewards - mean[inverse]
    return torch.where(constant[inverse], torch.zeros_like(adv), adv)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantage: ``A_i = r_i - (sum_g - r_i) / (n_g - 1)``, the leave-one-out mean of the other samples.

    The baseline does not depend on ``r_i`` so the estimator stays unbiased; it equals
    ``n_g / (n_g - 1) * (r_i - mean_g)``. A group of one has no other sample to form a baseline: it gets 0.
    """
    inverse, count, mean, constant = _group_stats(rewards, group_ids)
    n = count[inverse]
    total = (mean * count)[inverse]
    baseline = (total - rewards) / (n - 1).clamp(min=1)
    adv = rewards - baseline
    return torch.where(constant[inverse] | (n < 2), torch.zeros_like(adv), adv)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6,
                                     token_counts: Tensor | None = None) -> Tensor:
    """REINFORCE++-baseline advantage (ProRL v2): ``a_i = r_i - mean_g``, then ``A_i = a_i / (std(a) + eps)``.

    The group mean removes the prompt's difficulty; dividing by one std over the whole batch (population std
    of the centred values ``a`` of all N samples) normalises the scale without GRPO's per-group reweighting.
    Every group's centred values sum to 0, so the batch mean of ``a`` is 0 (and subtracting it changes nothing).

    With ``token_counts`` (each sample's trained tokens, ``[N]``) the whitening is over tokens instead, as
    OpenRLHF and verl do it (``masked_whiten`` of the per-token advantages): every sample's ``a_i`` counts once
    per token, ``A_i = (a_i - mean_tok) / (std_tok + eps)``. Long samples then weigh more in the mean and std, and
    the token-mean of the advantages is 0 rather than the sample mean.
    """
    return whiten(group_centred(rewards, group_ids), token_counts, eps)


def group_centred(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``r_i - mean_g``, exactly 0 for a group whose rewards are all equal (Dr. GRPO's advantage)."""
    inverse, _, mean, constant = _group_stats(rewards, group_ids)
    return torch.where(constant[inverse], torch.zeros_like(rewards), rewards - mean[inverse])


def whiten(values: Tensor, weights: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` over the batch, the population std; with ``weights`` (e.g. each sample's
    trained tokens) a weighted mean and std, each value counting that many times."""
    if values.numel() == 0:
        return values
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    total = w.sum().clamp(min=1e-12)
    mean = (w * values).sum() / total
    std = ((w * (values - mean).square()).sum() / total).sqrt()
    return (values - mean) / (std + eps)


# --- the registered estimators (trainer.advantage), one call signature for all: see pipelinerl/rl/registry.py


@register_advantage("grpo", reads=("group_std_unbiased",))
def _grpo(inputs: AdvantageInputs, cfg: TrainerConfig) -> Tensor:
    """:func:`grpo_advantages`; ``trainer.group_std_unbiased`` divides the group variance by n - 1 (verl, TRL)."""
    return grpo_advantages(inputs.rewards, inputs.group_ids, unbiased=cfg.group_std_unbiased)


@register_advantage("dr_grpo", reads=())
def _dr_grpo(inputs: AdvantageInputs, cfg: TrainerConfig) -> Tensor:
    return dr_grpo_advantages(inputs.rewards, inputs.group_ids)


@register_advantage("rloo", reads=())
def _rloo(inputs: AdvantageInputs, cfg: TrainerConfig) -> Tensor:
    return rloo_advantages(inputs.rewards, inputs.group_ids)


@register_advantage("reinforce_pp_baseline", reads=("whiten_over",), whitened=True)
def _reinforce_pp_baseline(inputs: AdvantageInputs, cfg: TrainerConfig) -> Tensor:
    """:func:`reinforce_pp_baseline_advantages`: the group-centred rewards here; the trainer whitens them over the
    batch's samples or (``trainer.whiten_over: tokens``) tokens, after the KL-to-go where there is one
    (``trainer.kl_reward: to_go``, OpenRLHF's order)."""
    return group_centred(inputs.rewards, inputs.group_ids)


@register_advantage("gae", token_level=True, reads=("critic",))
def _gae(inputs: AdvantageInputs, cfg: TrainerConfig) -> Tensor:
    """PPO with a critic (ORZ): generalised advantage estimation over each sample's tokens from the critic's values
    (``trainer.critic``), computed by the trainer with ``pipelinerl.rl.values.gae_advantages``."""
    raise RuntimeError("gae is computed per token by the trainer from the critic's values, not per sample")
