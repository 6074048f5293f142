"""What scoring one completion gives: `RewardResult`, returned by every verifier and carried out of the reward pool's
workers (`pipelinerl.rewards.pool`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardResult:
    """One scored completion: the reward, its named components (e.g. `correct`) and why, when it is not plain."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    info: str = ""
