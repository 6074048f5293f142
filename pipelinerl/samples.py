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
    # Multi-turn rollouts (pipelinerl.tasks.workflow): 1 on the tokens the model wrote, 0 on tokens the environment put
    # in the context (a tool's output). The trainer trains on the 1s only; a 0 token has behaviour log-prob 0 and
    # version -1, as no policy produced it. Empty: every output token is the model's (single-turn).
    output_mask: list[int] = Field(default_factory=list)
    finish_reason: str
    reward: float = 0.0
    reward_parts: dict[str, float] = Field(default_factory=dict)
    reward_info: str = ""
    task: str = ""
    # the domain of a task that has several (`problem["domain"]`: a mix's sub-task, a Reasoning Gym generator); the
    # trainer's metrics and the held-out evaluation report each domain apart. Empty: the task is one domain
    domain: str = ""
    timings: dict[str, float] = Field(default_factory=dict)  # seconds per stage; multi-turn: turns, tool_calls too

    @model_validator(mode="after")
    def _lengths_agree(self) -> Sample:
        n = len(self.output_token_ids)
        if len(self.behav_logprobs) != n or len(self.versions) != n:
            raise ValueError(f"sample {self.group_id}: {n} output tokens but {len(self.behav_logprobs)} log-probs "
                             f"and {len(self.versions)} versions")
        if self.output_mask and (len(self.output_mask) != n or not set(self.output_mask) <= {0, 1}):
            raise ValueError(f"sample {self.group_id}: output_mask must hold one 0 or 1 per output token "
                             f"({n}), got {len(self.output_mask)} values")
        return self

    @property
    def correct(self) -> bool:
        """Whether the verifier judged the answer right (`reward_parts["correct"]`, whatever shaping did to the
        reward)."""
        return self.reward_parts.get("correct", 0.0) > 0

    @property
    def model_versions(self) -> list[int]:
        """The versions of the tokens the model wrote (tool output tokens carry none)."""
        if not self.output_mask:
            return self.versions
        return [v for v, m in zip(self.versions, self.output_mask) if m]

    @property
    def trained_tokens(self) -> int:
        """Output tokens the loss sees: the model's own."""
        return sum(self.output_mask) if self.output_mask else len(self.output_token_ids)

    @property
    def oldest_version(self) -> int:
        versions = self.model_versions
        return min(versions) if versions else -1

    def lag(self, trainer_version: int) -> int:
        """Versions between the trainer now and the first token the model wrote in this sample."""
        versions = self.model_versions
        return trainer_version - versions[0] if versions else 0


def domain_key(domain: str) -> str:
    """A domain's name as it appears inside metric keys (`domain_<key>_accuracy`): letters and digits kept, the
    rest `_`."""
    return "".join(c if c.isalnum() else "_" for c in domain)
