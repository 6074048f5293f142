"""RL loss library: advantages, policy losses, KL estimators and sequence packing, as tensor functions."""

from pipelinerl.rl.advantages import (
    dr_grpo_advantages,
    group_all_equal,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from pipelinerl.rl.kl import ReferenceResetPolicy, kl_estimate, reset_reference
from pipelinerl.rl.losses import (
    aggregate,
    decoupled_ppo_loss,
    effective_sample_size,
    entropy_from_logits,
    gspo_loss,
    logprobs_from_logits,
    masked_max,
    masked_mean,
    ppo_clip_loss,
    reinforce_is_loss,
)
from pipelinerl.rl.packing import (
    PackedBatch,
    build_packed_batch,
    pack_sequences,
    packed_causal_mask,
    to_additive_mask,
)

__all__ = [
    "PackedBatch",
    "ReferenceResetPolicy",
    "aggregate",
    "build_packed_batch",
    "decoupled_ppo_loss",
    "dr_grpo_advantages",
    "effective_sample_size",
    "entropy_from_logits",
    "group_all_equal",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "logprobs_from_logits",
    "masked_max",
    "masked_mean",
    "pack_sequences",
    "packed_causal_mask",
    "ppo_clip_loss",
    "reinforce_is_loss",
    "reinforce_pp_baseline_advantages",
    "reset_reference",
    "rloo_advantages",
    "to_additive_mask",
]
