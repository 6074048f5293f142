"""The reward service: a crash-isolated process pool running task verifiers, math answer checking, and
length shaping. See `pool`, `math` and `shaping`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelinerl.rewards.math import answers_match, last_boxed, math_reward, orz_reward, score_math, score_orz
from pipelinerl.rewards.pool import COUNTERS, RewardPool, RewardResult, function_ref
from pipelinerl.rewards.shaping import (
    cosine_length_reward,
    length_penalty_active,
    overlong_penalty,
    shape_reward,
    truncated_zero,
)

if TYPE_CHECKING:
    from pipelinerl.samples import Sample

__all__ = [
    "COUNTERS", "RewardPool", "RewardResult", "answers_match", "apply_result", "cosine_length_reward",
    "function_ref", "last_boxed", "length_penalty_active", "math_reward", "orz_reward", "overlong_penalty",
    "score_math", "score_orz", "shape_reward", "truncated_zero",
]


def apply_result(sample: Sample, result: RewardResult) -> Sample:
    """A copy of `sample` carrying the reward, its parts and the reason, as the trainer reads them."""
    return sample.model_copy(update={"reward": result.reward, "reward_parts": dict(result.parts),
                                     "reward_info": result.info})
