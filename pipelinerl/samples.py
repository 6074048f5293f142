"""The record that flows from the actor through the reward service and the stream to the trainer.

One `Sample` is one completion of one prompt; the G samples of a prompt share a `group_id` and travel
together (a group goes downstream only when all its attempts are scored).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int]
    behav_logprobs: list[float] = Field(description="engine log-probs of output tokens (behaviour policy)")
    versions: list[int] = Field(description="weight version that produced each output token")
    finish_reason: str
    reward: float = 0.0
    reward_parts: dict[str, float] = Field(default_factory=dict)
    reward_info: str = ""
    task: str = ""
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lengths_agree(self) -> Sample:
        n = len(self.output_token_ids)
        if len(self.behav_logprobs) != n or len(self.versions) != n:
            raise ValueError(f"sample {self.group_id}: {n} output tokens but {len(self.behav_logprobs)} log-probs "
                             f"and {len(self.versions)} versions")
        return self

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else -1

    def lag(self, trainer_version: int) -> int:
        """Versions between the trainer now and the first token of this sample."""
        return trainer_version - self.versions[0] if self.versions else 0
