"""PPO with a critic: generalised advantage estimation and the clipped value loss (pure functions).

ORZ trains Qwen2.5 base models with exactly this (GAE with gamma = lambda = 1, value clip 0.2, advantages
normalised over the batch); the formulas are the PPO paper's (Schulman et al. 2017, GAE: Schulman et al. 2016) as
OpenRLHF and ORZ (`orz/ppo/utils.py: get_advantages_and_returns`) implement them.

Time steps are a sequence's *action* tokens, the ones the model generated and the loss trains on (``mask``); a
prompt token, or a tool's output inside a multi-turn answer, is not a step, so GAE runs over each sequence's masked
tokens in order, as if the others were not there. The state before the last action is followed by the end of the
episode: V after it is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, seq_ids: Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Advantages and returns of every token of a packed row, both ``[T]`` float32 (0 off ``mask``).

    ``rewards[t]``: the reward received after action t (the task's reward on a sequence's last action, a per-token
    KL penalty anywhere); ``values[t]``: the critic's V(s_t), the value of the state before token t; ``mask``:
    True on actions; ``seq_ids``: each token's sequence. Per sequence, over its actions t_1 < ... < t_n:

        delta_i = r_i + gamma * V_{i+1} - V_i            (V_{n+1} = 0: the episode ends)
        A_i     = delta_i + gamma * lam * A_{i+1}        (A_{n+1} = 0)
        R_i     = A_i + V_i                              (the critic's regression target)

    With gamma = lam = 1 (ORZ): A_i = sum_{j >= i} r_j - V_i, computed in closed form.
    """
    out_adv = torch.zeros_like(rewards, dtype=torch.float32)
    out_ret = torch.zeros_like(out_adv)
    actions = mask.nonzero().squeeze(1)
    if actions.numel() == 0:
        return out_adv, out_ret
    r, v = _left_aligned(rewards[actions].float(), values[actions].float(), seq_ids[actions])
    if gamma == 1.0 and lam == 1.0:
        # right-padding is 0, so a reverse cumulative sum over the row is the sum of the rewards still to come
        returns_to_go = r.flip(1).cumsum(1).flip(1)
        adv = returns_to_go - v
    else:
        adv = torch.zeros_like(r)
        next_value = torch.zeros_like(r[:, 0])
        next_adv = torch.zeros_like(next_value)
        for i in range(r.shape[1] - 1, -1, -1):  # padding after a row's end has r = V = 0, so A stays 0 there
            next_adv = r[:, i] + gamma * next_value - v[:, i] + gamma * lam * next_adv
            adv[:, i] = next_adv
            next_value = v[:, i]
    ret = adv + v
    valid = _row_positions(seq_ids[actions])
    out_adv[actions] = adv[valid]
    out_ret[actions] = ret[valid]
    return out_adv, out_ret


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
               ) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss and whether the clipped term was the larger one, both ``[T]``.

    ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = old + clamp(V - old, -clip, clip)`` (PPO's value
    clipping as OpenRLHF's and ORZ's ``ValueLoss``: the critic moves at most ``clip`` from the values the advantages
    were computed with, unless that lowers the loss); ``0.5 * (V - R)^2`` when ``clip`` is None. Aggregate over the
    action tokens with the caller's mask.
    """
    plain = (values - returns).square()
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(plain, clipped), clipped > plain


def _row_positions(seq: Tensor) -> tuple[Tensor, Tensor]:
    """(row, column) of each action in the left-aligned ``[sequences, longest]`` layout. Actions of one sequence
    are contiguous and in order in a packed row."""
    _, rows, counts = torch.unique_consecutive(seq, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(seq.numel(), device=seq.device) - starts[rows]
    return rows, cols


def _left_aligned(rewards: Tensor, values: Tensor, seq: Tensor) -> tuple[Tensor, Tensor]:
    """The actions' rewards and values as ``[sequences, longest]`` rows, right-padded with 0."""
    rows, cols = _row_positions(seq)
    shape = (int(rows.max()) + 1, int(cols.max()) + 1)
    r = rewards.new_zeros(shape)
    v = values.new_zeros(shape)
    r[rows, cols] = rewards
    v[rows, cols] = values
    return r, v
