"""The reward service: a crash-isolated process pool running task verifiers, math answer checking (math-verify in
`math`, Open-Reasoner-Zero's own check in `orz_exact`, multiple choice in `choice`), and length shaping (`shaping`).
`bench/reward_agreement.py` measures how the two ORZ rules differ."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelinerl.rewards.choice import choice_reward, is_choice_problem, score_choice
from pipelinerl.rewards.math import answers_match, last_boxed, math_reward, orz_reward, score_math, score_orz
from pipelinerl.rewards.orz_exact import orz_exact_reward, score_orz_exact
from pipelinerl.rewards.pool import COUNTERS, RewardPool, function_ref
from pipelinerl.rewards.result import RewardResult
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
    "COUNTERS", "RewardPool", "RewardResult", "answers_match", "apply_result", "choice_reward", "cosine_length_reward",
    "function_ref", "is_choice_problem", "last_boxed", "length_penalty_active", "math_reward", "orz_exact_reward",
    "orz_reward", "overlong_penalty", "score_choice", "score_math", "score_orz", "score_orz_exact", "shape_reward",
    "truncated_zero",
]


def apply_result(sample: Sample, result: RewardResult) -> Sample:
    """A copy of `sample` carrying the reward, its parts and the reason, as the trainer reads them."""
    return sample.model_copy(update={"reward": result.reward, "reward_parts": dict(result.parts),
                                     "reward_info": result.info})
