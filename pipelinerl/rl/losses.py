"""Per-token policy-gradient losses and their aggregation.

Conventions shared by every loss here:

* All per-token inputs have the same shape, either ``[T]`` (a packed batch, sequences concatenated) or
  ``[B, L]`` (one sequence per row, padded).
* ``logprobs``: log-probabilities of the sampled tokens under the current policy (they carry the gradient).
  ``behav_logprobs``: as reported by the inference engine that sampled the tokens (behaviour policy).
  ``old_logprobs`` / ``prox_logprobs``: recomputed by the trainer before the update (PPO's "old" policy,
  AReaL's proximal policy). All of these reference log-probs and ``advantages`` are detached inside the
  losses.
* ``mask``: bool or 0/1 float, True where the token is trained on (completion tokens, not prompt or padding).
* Every loss returns ``(per_token_loss, stats)``: the loss is 0 on masked-out tokens, so that a plain ``sum``
  is safe, and it is meant to be reduced with :func:`aggregate`. ``stats`` maps names to detached scalar
  tensors computed over the masked tokens (no ``.item()``, so no device sync here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from pipelinerl.rl.registry import LossInputs, register_policy_loss

if TYPE_CHECKING:
    from pipelinerl.config import TrainerConfig

AggregationMode = Literal["token_sum_norm", "token_mean", "seq_mean"]


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match {tuple(like.shape)}")
    return mask.bool()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true (0 if there are none)."""
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum()
    return total / m.sum().clamp(min=1)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over the positions where ``mask`` is true (0 if there are none)."""
    m = mask.bool()
    if x.numel() == 0:
        return x.new_zeros(())
    top = torch.where(m, x, torch.full_like(x, float("-inf"))).max()
    return torch.where(m.any(), top, torch.zeros_like(top))


def _ppo_clip_terms(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                    clip_ratio_c: float | None = None) -> Tensor:
    """``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` per token, and with dual-clip
    (``clip_ratio_c``) at most ``-clip_ratio_c * A`` where ``A < 0``."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -clip_ratio_c * advantages), loss)
    return loss


def _clip_fracs(ratio: Tensor, advantages: Tensor, m: Tensor, clip_low: float, clip_high: float,
                clip_ratio_c: float | None = None) -> dict:
    """Fractions of masked tokens where the clipped branch is active at the low / high bound (and the dual clip)."""
    ratio = ratio.detach()
    stats = {
        "clip_low_frac": masked_mean(((advantages < 0) & (ratio < 1.0 - clip_low)).float(), m),
        "clip_high_frac": masked_mean(((advantages > 0) & (ratio > 1.0 + clip_high)).float(), m),
    }
    if clip_ratio_c is not None:
        stats["dual_clip_frac"] = masked_mean(((advantages < 0) & (ratio > clip_ratio_c)).float(), m)
    return stats


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric ("clip-higher", DAPO) bounds, and optionally dual-clip.

    ``ratio = exp(logp - old)``; ``loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.
    The clip removes the incentive to move a token's probability further once the ratio has left the trust
    region in the direction the advantage pushes: the clipped branch is constant, so its gradient is 0.

    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl's ``clip_ratio_c``): where
    ``A < 0`` the loss is also capped at ``-clip_ratio_c * A`` (``clip_ratio_c > 1``, 3 in verl). Without it a
    token whose ratio has grown huge (a stale sample the policy now likes much more) contributes
    ``-ratio * A``, unbounded; with it, past ``ratio > clip_ratio_c`` the loss is constant and the gradient 0.

    Stats: ``clip_low_frac`` (A < 0 and ratio < 1 - clip_low: clipped at the low bound), ``clip_high_frac``
    (A > 0 and ratio > 1 + clip_high), ``dual_clip_frac`` (with dual-clip: A < 0 and ratio > clip_ratio_c),
    ``ratio_mean``, ``ratio_max``.
    """
    m = _bool_mask(mask, logprobs)
    advantages = advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())
    loss = _ppo_clip_terms(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    stats = _clip_fracs(ratio, advantages, m, clip_low, clip_high, clip_ratio_c)
    stats.update(ratio_mean=masked_mean(ratio.detach(), m), ratio_max=masked_max(ratio.detach(), m))
    return loss, stats


def effective_sample_size(weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised ESS of importance weights: ``(sum w)^2 / (n * sum w^2)`` over the masked tokens, in [0, 1].

    1 means the behaviour and current policies agree on these tokens; values near 1/n mean a few tokens carry
    all the weight. Returns 1 when there are no tokens.
    """
    m = mask.bool()
    w = torch.where(m, weights, torch.zeros_like(weights))
    n = m.sum()
    sq = w.square().sum()
    ess = w.sum().square() / (n * sq).clamp(min=torch.finfo(w.dtype).tiny)
    return torch.where((n > 0) & (sq > 0), ess, torch.ones_like(ess))


def reinforce_is_loss(
    logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_cap: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-weighted REINFORCE (the PipelineRL default).

    ``w = min(exp(logp - behav), is_cap)`` (detached) and ``loss = -w * A * logp``, so that
    ``dloss/dlogp = -w * A``. The weight corrects for tokens sampled by a slightly stale behaviour policy
    (in-flight weight updates); the cap bounds the variance when the policies disagree (truncated IS).

    Stats: ``is_weight_mean`` and ``is_weight_max`` of the uncapped weights, ``is_capped_frac`` (tokens whose
    weight hit the cap) and ``ess`` (:func:`effective_sample_size` of the uncapped weights).
    """
    m = _bool_mask(mask, logprobs)
    raw_w = torch.exp(logprobs.detach() - behav_logprobs.detach())
    w = raw_w.clamp(max=is_cap)
    loss = -w * advantages.detach() * logprobs
    loss = torch.where(m, loss, torch.zeros_like(loss))
    stats = {
        "is_weight_mean": masked_mean(raw_w, m),
        "is_weight_max": masked_max(raw_w, m),
        "is_capped_frac": masked_mean((raw_w > is_cap).float(), m),
        "ess": effective_sample_size(raw_w, m),
    }
    return loss, stats


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    behav_cap: float | None = None,
    clip_ratio_c: float | None = None,
    seq_ids: Tensor | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL decoupled PPO: trust region around the proximal policy, importance weight to the behaviour one.

    ``ratio = exp(logp - prox)`` is PPO-clipped as in :func:`ppo_clip_loss` (dual-clip included); the result is
    multiplied by the detached behaviour weight ``w = exp(prox - behav)``. With ``behav_cap`` set, tokens with
    ``w > behav_cap`` are dropped (loss and gradient 0), AReaL's ``behav_imp_weight_cap``. As in AReaL,
    dropped tokens should still be counted by :func:`aggregate` (pass the original ``mask`` there), so they
    dilute rather than re-weight.

    The proximal policy is the trainer's weights before the batch's first optimizer update: with one update
    per batch ``ratio`` is 1 and only the behaviour weight acts; with ``trainer.ppo_minibatches`` > 1 the later
    updates move away from it and the clip bounds them.

    ``importance_sampling_level="sequence"`` (AReaL's option) takes the proximal ratio per sequence, as the
    geometric mean of its token ratios in GSPO's straight-through form (see :func:`gspo_loss`; needs
    ``seq_ids`` for a packed layout); the behaviour weight stays per token.

    Stats: the PPO clip stats of the proximal ratio, plus ``behav_weight_mean`` / ``behav_weight_max`` (before
    capping) and ``behav_capped_frac``; at the sequence level also ``seq_ratio_mean`` / ``seq_ratio_max``.
    """
    m = _bool_mask(mask, logprobs)
    if importance_sampling_level == "sequence":
        ratio, seq_ratio = _sequence_ratio(logprobs, prox_logprobs, m, seq_ids)
        adv = advantages.detach()
        ppo = torch.where(m, _ppo_clip_terms(ratio, adv, clip_low, clip_high, clip_ratio_c), torch.zeros_like(ratio))
        stats = _clip_fracs(ratio, adv, m, clip_low, clip_high, clip_ratio_c)
        stats.update(ratio_mean=masked_mean(ratio.detach(), m), ratio_max=masked_max(ratio.detach(), m))
        has_tokens = ~torch.isnan(seq_ratio)
        stats["seq_ratio_mean"] = masked_mean(seq_ratio.nan_to_num(), has_tokens)
        stats["seq_ratio_max"] = masked_max(seq_ratio.nan_to_num(), has_tokens)
    elif importance_sampling_level == "token":
        ppo, stats = ppo_clip_loss(logprobs, prox_logprobs, advantages, mask, clip_low, clip_high, clip_ratio_c)
    else:
        raise ValueError(f"importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
    w = torch.exp(prox_logprobs.detach() - behav_logprobs.detach())
    keep = m
    if behav_cap is not None:
        keep = m & (w <= behav_cap)
    loss = torch.where(keep, ppo * w, torch.zeros_like(ppo))
    stats.update(
        behav_weight_mean=masked_mean(w, m),
        behav_weight_max=masked_max(w, m),
        behav_capped_frac=masked_mean((m & ~keep).float(), m),
    )
    return loss, stats


def _sequence_index(like: Tensor, seq_ids: Tensor | None) -> tuple[Tensor, int]:
    """Flat ``[numel]`` dense sequence index for a ``[T]`` (needs seq_ids) or ``[B, L]`` (rows) layout."""
    if seq_ids is None:
        if like.ndim != 2:
            raise ValueError("seq_ids is required for a 1-D (packed) layout; a [B, L] layout uses rows")
        rows = torch.arange(like.shape[0], device=like.device)
        return rows[:, None].expand_as(like).reshape(-1), like.shape[0]
    if seq_ids.shape != like.shape:
        raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} does not match {tuple(like.shape)}")
    _, inverse = torch.unique(seq_ids.reshape(-1), sorted=True, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def _per_sequence_sum(x: Tensor, index: Tensor, num_seqs: int) -> Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, index, x.reshape(-1))


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clipping on a length-normalised sequence-level ratio.

    ``s_i = exp(mean_{t in i} (logp_t - old_t))`` over the masked tokens of sequence i. It is applied per
    token in GSPO-token's straight-through form ``s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))``: its value
    is ``s_i`` and ``ds_{i,t}/dlogp_t = s_i``, so with ``aggregate(..., "seq_mean")`` and a
    sequence-constant advantage the gradient is exactly GSPO's ``s_i * A_i * mean_t grad logp_t``. The clip
    decision is therefore per sequence; GSPO uses tiny ranges (3e-4 / 4e-4) because the ratio is a geometric
    mean.

    Layout: ``[B, L]`` tensors, one sequence per row (``seq_ids`` may be omitted), or packed ``[T]`` tensors
    with ``seq_ids [T]`` giving each token's sequence (any integer labels). Stats: token clip fractions as
    in :func:`ppo_clip_loss` plus ``seq_ratio_mean`` / ``seq_ratio_max`` over sequences with trained tokens.
    """
    m = _bool_mask(mask, logprobs)
    advantages = advantages.detach()
    token_ratio, seq_ratio = _sequence_ratio(logprobs, old_logprobs, m, seq_ids)
    loss = _ppo_clip_terms(token_ratio, advantages, clip_low, clip_high)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    stats = _clip_fracs(token_ratio, advantages, m, clip_low, clip_high)
    has_tokens = ~torch.isnan(seq_ratio)
    stats["seq_ratio_mean"] = masked_mean(seq_ratio.nan_to_num(), has_tokens)
    stats["seq_ratio_max"] = masked_max(seq_ratio.nan_to_num(), has_tokens)
    return loss, stats


def _sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, m: Tensor, seq_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """GSPO-token's per-token ratio (value ``s_i``, gradient ``s_i`` per log-prob) and the sequence ratios
    ``s_i`` (NaN for a sequence with no trained token)."""
    index, num_seqs = _sequence_index(logprobs, seq_ids)
    log_ratio = torch.where(m, logprobs.detach() - old_logprobs.detach(), torch.zeros_like(logprobs))
    count = _per_sequence_sum(m.to(logprobs.dtype), index, num_seqs)
    seq_ratio = torch.exp(_per_sequence_sum(log_ratio, index, num_seqs) / count.clamp(min=1))
    token_ratio = seq_ratio[index].view_as(logprobs) * torch.exp(logprobs - logprobs.detach())
    return token_ratio, torch.where(count > 0, seq_ratio, torch.full_like(seq_ratio, float("nan")))


def aggregate(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: AggregationMode,
    num_sequences: int | float | Tensor | None = None,
    seq_ids: Tensor | None = None,
    num_tokens: int | float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss to the scalar to back-propagate.

    * ``"token_sum_norm"`` (PipelineRL): ``sum_t loss_t / num_sequences``, where ``num_sequences`` is the
      number of sequences in the whole optimizer update (required; the trainer passes the batch it trains). Every
      token then has the same weight whatever micro-batch it lands in, so summing the micro-batch losses gives the
      step's loss.
    * ``"token_mean"`` (DAPO): ``sum_t loss_t / num_tokens``; ``num_tokens`` defaults to the masked tokens
      of this call; pass the step's total when accumulating micro-batches.
    * ``"seq_mean"`` (GRPO, GSPO): ``sum_i mean_{t in i} loss_t / n``: each sequence's token mean, averaged
      over sequences. ``n`` is ``num_sequences`` if given (for accumulation), else the number of sequences
      here with at least one masked token. Sequences are rows of a ``[B, L]`` layout or given by ``seq_ids``
      for ``[T]``.
    """
    m = _bool_mask(mask, per_token_loss)
    masked = torch.where(m, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token_sum_norm":
        if num_sequences is None:
            raise ValueError("token_sum_norm needs num_sequences (sequences per optimizer step)")
        return masked.sum() / num_sequences
    if mode == "token_mean":
        denom = m.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked.sum() / denom
    if mode == "seq_mean":
        index, num_seqs = _sequence_index(per_token_loss, seq_ids)
        seq_sum = _per_sequence_sum(masked, index, num_seqs)
        count = _per_sequence_sum(m.to(masked.dtype), index, num_seqs)
        seq_mean = seq_sum / count.clamp(min=1)
        denom = (count > 0).sum().clamp(min=1) if num_sequences is None else num_sequences
        return seq_mean.sum() / denom
    raise ValueError(f"unknown aggregation mode {mode!r}; expected token_sum_norm, token_mean or seq_mean")


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)[label]`` per position, computed in float32.

    Uses ``gather - logsumexp`` so that no ``[..., V]`` log-softmax tensor is kept for backward.
    The temperature must match the sampler's for the log-probs to be comparable with the engine's.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    Written this way (rather than ``-sum p log p``) it is stable for peaked distributions. Computed in
    float32; logits must be finite. Returns shape ``logits.shape[:-1]``.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


# --- the registered policy losses (trainer.policy_loss), one call signature for all: see pipelinerl/rl/registry.py


@register_policy_loss("reinforce_is", zero_without_advantage=True, reads=("is_cap",))
def _reinforce_is(logprobs: Tensor, inputs: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-weighted REINFORCE: :func:`reinforce_is_loss` with ``trainer.is_cap``. PipelineRL's own loss is
    this with a cap of 1.02 (its ``epsilon_high`` 0.02): ``recipes/presets/pipelinerl.yaml``."""
    return reinforce_is_loss(logprobs, inputs.behav_logprobs, inputs.advantages, inputs.mask, cfg.is_cap)


@register_policy_loss("ppo_clip", zero_without_advantage=True, reads=("clip_low", "clip_high", "clip_ratio_c"))
def _ppo_clip(logprobs: Tensor, inputs: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip_loss` around the behaviour policy (the engine's log-probs): the ratio both corrects and
    bounds the staleness of in-flight samples ("coupled" PPO, AReaL's baseline), and with
    ``trainer.ppo_minibatches`` > 1 the later updates' drift too."""
    return ppo_clip_loss(logprobs, inputs.behav_logprobs, inputs.advantages, inputs.mask, cfg.clip_low,
                         cfg.clip_high, cfg.clip_ratio_c)


def _behav_cap(cfg: TrainerConfig) -> float | None:
    """trainer.behav_imp_weight_cap, 0 meaning no cap."""
    return cfg.behav_imp_weight_cap or None


@register_policy_loss("decoupled_ppo", needs_proximal=True, zero_without_advantage=True,
                      reads=("clip_low", "clip_high", "clip_ratio_c", "behav_imp_weight_cap",
                             "importance_sampling_level"),
                      # AReaL's default and its advice: without a cap one token far off the behaviour policy can
                      # carry a weight of thousands
                      defaults={"behav_imp_weight_cap": 5.0})
def _decoupled_ppo(logprobs: Tensor, inputs: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`decoupled_ppo_loss` with ``trainer.behav_imp_weight_cap`` (5 unless set; 0: none) and
    ``importance_sampling_level``."""
    return decoupled_ppo_loss(logprobs, inputs.prox_logprobs, inputs.behav_logprobs, inputs.advantages, inputs.mask,
                              cfg.clip_low, cfg.clip_high, _behav_cap(cfg), cfg.clip_ratio_c,
                              inputs.seq_ids, cfg.importance_sampling_level)


@register_policy_loss("gspo", needs_proximal=True, clip=(3e-4, 4e-4), aggregation="seq_mean",
                      zero_without_advantage=True, reads=("clip_low", "clip_high", "behav_imp_weight_cap"),
                      defaults={"behav_imp_weight_cap": 5.0})
def _gspo(logprobs: Tensor, inputs: LossInputs, cfg: TrainerConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's sequence-level trust region taken around the proximal policy (the trainer's weights before the
    batch's first update, as verl recomputes its old log-probs), so that the ratio is 1 at the first update
    whatever the samples' lag; the behaviour policy's staleness is corrected apart, by the detached per-token
    weight ``pi_prox / pi_behav`` (tokens above ``trainer.behav_imp_weight_cap`` dropped: 5 unless set, 0 for
    none), as in decoupled PPO; verl applies no behaviour correction unless asked. GSPO's own clip range and
    sequence-mean aggregation unless the config sets them.

    Around the behaviour policy instead, a sample one version stale is already outside GSPO's 3e-4 range before
    any update, and the clip acts as a staleness filter (half the sequences of the tiny recipe at lag 1)."""
    return decoupled_ppo_loss(logprobs, inputs.prox_logprobs, inputs.behav_logprobs, inputs.advantages, inputs.mask,
                              cfg.clip_low, cfg.clip_high, _behav_cap(cfg), seq_ids=inputs.seq_ids,
                              importance_sampling_level="sequence")
