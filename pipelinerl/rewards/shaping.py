"""Reward shaping by output length, as pure functions of (reward, correctness, length, finish reason, step).

- `overlong_penalty`: DAPO's soft overlong punishment. Outputs inside the last `buffer_len` tokens before the
  limit lose reward linearly, so the model learns to finish before the hard cut instead of being cut off.
- `cosine_length_reward`: the cosine length-scaled reward (Yeo et al. 2025, "Demystifying Long Chain-of-Thought
  Reasoning in LLMs"; used with an on/off schedule in ProRL v2): correct answers earn more when short, wrong
  answers are punished less when long (so the model keeps thinking when it is unsure), and an output cut off by
  the length limit gets the exceed-length penalty instead (-10 in the paper), so running into the limit is never
  the best a wrong answer can do.
- `length_penalty_active`: ProRL v2 switches the length penalty on and off in periods, alternating compression
  with free exploration.
- `truncated_zero`: the Open-Reasoner-Zero rule that an output cut off by the length limit earns nothing.
- `shape_reward`: the above combined as `RewardConfig` says, for the actor to call after scoring.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelinerl.config import RewardConfig

TRUNCATED = "length"  # finish_reason of an output that hit the token limit


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """0 up to `max_len - buffer_len` tokens, then linearly down to `-penalty_factor` at `max_len` (and beyond)."""
    if buffer_len <= 0:
        return 0.0
    free = max_len - buffer_len
    if length <= free:
        return 0.0
    return -penalty_factor * min(1.0, (length - free) / buffer_len)


def cosine_interpolate(length: int, max_len: int, value_at_zero: float, value_at_max: float) -> float:
    """Half a cosine from `value_at_zero` (length 0) to `value_at_max` (length >= max_len): flat at both ends."""
    t = min(max(length, 0), max_len) / max_len
    return value_at_max + 0.5 * (value_at_zero - value_at_max) * (1.0 + math.cos(math.pi * t))


def cosine_length_reward(correct: bool, length: int, max_len: int, r_correct_short: float = 2.0,
                         r_correct_long: float = 1.0, r_wrong_short: float = -10.0,
                         r_wrong_long: float = 0.0, truncated: bool = False,
                         r_exceed: float | None = -10.0) -> float:
    """The cosine length-scaled reward; defaults are the paper's (r0c=2, rLc=1, r0w=-10, rLw=0, r_exceed=-10).

    A `truncated` output (one that hit the length limit) gets `r_exceed` whether or not its answer was right, as
    in the paper's code (eddycmu/demystify-long-cot, `openrlhf/openrlhf/reward/cosine.py`: the exceed value
    replaces the cosine value, checked before correctness; its scripts pass `--math_rule_common_exceed_length -10`).
    Without it a truncated wrong answer would earn r_wrong_long, the best a wrong answer can get, and the policy
    would learn to run into the limit. The paper's code recognises truncation by length (within 16 tokens of the
    limit); here it is the engine's finish_reason "length", which says so exactly. `r_exceed=None` switches the
    penalty off: a truncated output then scores by its length like any other.
    """
    if truncated and r_exceed is not None:
        return r_exceed
    if correct:
        return cosine_interpolate(length, max_len, r_correct_short, r_correct_long)
    return cosine_interpolate(length, max_len, r_wrong_short, r_wrong_long)


def length_penalty_active(step: int, on_steps: int, off_steps: int) -> bool:
    """Periodic schedule: on for `on_steps` steps, then off for `off_steps`, repeating from step 0.

    `off_steps <= 0` means always on; `on_steps <= 0` (with off_steps > 0) means never on.
    """
    if off_steps <= 0:
        return True
    if on_steps <= 0:
        return False
    return step % (on_steps + off_steps) < on_steps


def truncated_zero(reward: float, finish_reason: str) -> float:
    """0 for an output that hit the length limit, else the reward unchanged."""
    return 0.0 if finish_reason == TRUNCATED else reward


def shape_reward(reward: float, correct: bool, length: int, finish_reason: str, max_len: int, step: int,
                 cfg: RewardConfig) -> tuple[float, dict[str, float]]:
    """The scored reward shaped as `cfg` asks; returns (reward, parts), parts naming each applied term.

    Order: the cosine length reward (when on; with its exceed-length penalty for a truncated output) replaces the
    task reward, the overlong penalty is added, and `truncated_zero` has the last word.
    """
    parts: dict[str, float] = {}
    if cfg.cosine_length and length_penalty_active(step, cfg.cosine_on_steps, cfg.cosine_off_steps):
        shaped = cosine_length_reward(correct, length, max_len, cfg.cosine_r_correct_short,
                                      cfg.cosine_r_correct_long, cfg.cosine_r_wrong_short, cfg.cosine_r_wrong_long,
                                      truncated=finish_reason == TRUNCATED, r_exceed=cfg.cosine_r_exceed)
        parts["cosine_length"] = shaped - reward
        reward = shaped
    if cfg.overlong_buffer > 0:
        penalty = overlong_penalty(length, max_len, cfg.overlong_buffer, cfg.overlong_penalty)
        parts["overlong"] = penalty
        reward += penalty
    if cfg.truncated_zero and finish_reason == TRUNCATED:
        parts["truncated"] = -reward
        reward = 0.0
    return reward, parts
