"""KL penalty estimators and ProRL-style reference-policy resets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

KLKind = Literal["k1", "k2", "k3"]
# k3's bounds (see kl_estimate): verl's low_var_kl clamps the same way
K3_LOG_RATIO_MAX = 20.0
K3_MAX = 10.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman's k1/k2/k3).

    With ``d = logp - ref`` (tokens sampled from pi):

    * ``k1 = d``: unbiased, but can be negative per token and has high variance.
    * ``k2 = d^2 / 2``: biased, always >= 0, low variance; its gradient is that of the reverse-KL penalty.
    * ``k3 = exp(-d) - (-d) - 1 = exp(ref - logp) - (ref - logp) - 1``: unbiased and >= 0 (GRPO's choice).
      Its exponential overflows to inf where the reference finds a sampled token far likelier than the policy
      does, and one inf skips the whole step; so, as verl and PipelineRL do, ``ref - logp`` is clamped to
      ``[-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX]`` and the estimate to at most ``K3_MAX`` (no gradient beyond).

    Gradients flow through both arguments; detach ``ref_logprobs`` upstream (it normally has no grad anyway).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch {tuple(logprobs.shape)} vs {tuple(ref_logprobs.shape)}")
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "k3":
        log_r = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
        return (torch.exp(log_r) - log_r - 1.0).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def kl_to_go(kl: Tensor, mask: Tensor, seq_ids: Tensor) -> Tensor:
    """Each token's KL reward-to-go in a packed ``[T]`` layout: the sum of ``kl`` over the masked tokens of its own
    sequence from it to the sequence's end (0 off ``mask``). With the outcome reward on the last token and
    gamma = 1, the return at token t is ``reward - kl_coef * kl_to_go[t]`` (OpenRLHF's REINFORCE++ returns).
    A sequence's tokens need not be contiguous (a shared prompt may sit between): they are summed in order."""
    if not (kl.shape == mask.shape == seq_ids.shape) or kl.ndim != 1:
        raise ValueError(f"kl, mask and seq_ids must be [T] tensors of one shape, got {tuple(kl.shape)}, "
                         f"{tuple(mask.shape)}, {tuple(seq_ids.shape)}")
    x = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    order = torch.sort(seq_ids, stable=True).indices  # each sequence's tokens together, in their order
    xs, ids = x[order], seq_ids[order]
    suffix = xs.flip(0).cumsum(0).flip(0)  # from each token to the end of the row, in sequence order
    # the part of that suffix that belongs to later sequences: the suffix at the next sequence's first token
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    start_suffix = torch.where(starts, suffix, torch.zeros_like(suffix))
    start_pos = starts.nonzero().squeeze(1)
    seq_index = starts.long().cumsum(0) - 1  # dense index of each token's sequence
    after = torch.cat([start_suffix[start_pos[1:]], suffix.new_zeros(1)])  # suffix of the next sequence's start
    next_start = after[seq_index]
    out = torch.empty_like(x)
    out[order] = suffix - next_start
    return torch.where(mask.bool(), out, torch.zeros_like(out))


@dataclass
class ReferenceResetPolicy:
    """When to hard-reset the KL reference policy to the current policy (ProRL v2).

    A KL penalty against a fixed reference eventually dominates the loss and stalls learning; ProRL resets the
    reference to the online policy periodically, and when the run stops improving.

    ``should_reset(step, kl_value)`` is True when ``every_n_steps`` steps have passed since the last reset
    (the start of training counts as a reset at step 0), when ``kl_value`` exceeds ``kl_threshold`` (a KL
    spike: the policy has moved far from its reference), or when the validation score has not improved for
    ``patience`` evaluations in a row (reported with :meth:`note_score`; ProRL resets "when validation
    performance stagnates"). Any criterion may be None (disabled). A True answer is recorded as a reset at
    ``step`` (and starts a new patience count), so the caller is expected to act on it (e.g. with
    :func:`reset_reference`).
    """

    every_n_steps: int | None = None
    kl_threshold: float | None = None
    patience: int | None = None
    last_reset_step: int = 0
    best_score: float = float("-inf")
    evals_without_improvement: int = 0

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be positive or None, got {self.every_n_steps}")
        if self.patience is not None and self.patience <= 0:
            raise ValueError(f"patience must be positive or None, got {self.patience}")

    def note_score(self, score: float) -> None:
        """A held-out validation score (higher is better)."""
        if score > self.best_score:
            self.best_score, self.evals_without_improvement = score, 0
        else:
            self.evals_without_improvement += 1

    @property
    def stagnating(self) -> bool:
        return self.patience is not None and self.evals_without_improvement >= self.patience

    def should_reset(self, step: int, kl_value: float | Tensor | None = None, stagnating: bool | None = None) -> bool:
        """``stagnating`` overrides this object's own count (a trainer rank other than the one that evaluates)."""
        periodic = self.every_n_steps is not None and step - self.last_reset_step >= self.every_n_steps
        spiked = (
            self.kl_threshold is not None and kl_value is not None and float(kl_value) > self.kl_threshold
        )
        stalled = self.stagnating if stagnating is None else stagnating
        if periodic or spiked or stalled:
            self.last_reset_step = step
            self.evals_without_improvement = 0
            return True
        return False


@dataclass
class KLCoefficient:
    """The KL coefficient over the run (``trainer.kl_schedule``).

    * ``constant``: ``start`` throughout.
    * ``linear``: from ``start`` to ``end`` over ``steps`` optimizer steps, then ``end`` (e.g. a KL that
      anchors early training and then lets go).
    * ``adaptive``: Ziegler et al. 2019's controller (OpenRLHF's and TRL's ``AdaptiveKLController``): after each
      step, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon`` with ``n`` the step's samples, so
      the measured KL is steered towards ``target``.
    """

    start: float
    schedule: Literal["constant", "linear", "adaptive"] = "constant"
    end: float = 0.0
    steps: int = 0
    target: float = 0.01
    horizon: int = 10000
    value: float = field(init=False)

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "linear", "adaptive"):
            raise ValueError(f"unknown KL schedule {self.schedule!r}; expected constant, linear or adaptive")
        self.value = self.start

    def at_step(self, step: int) -> float:
        """The coefficient for optimizer step ``step`` (0-based), before its update."""
        if self.schedule == "linear":
            t = min(max(step, 0), self.steps) / max(self.steps, 1)
            self.value = self.start + (self.end - self.start) * t
        return self.value

    def update(self, kl: float, num_samples: int) -> None:
        """After a step with mean per-token KL ``kl`` over ``num_samples`` samples (only ``adaptive`` changes)."""
        if self.schedule == "adaptive" and math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * num_samples / self.horizon


@torch.no_grad()
def reset_reference(ref_model: nn.Module, policy_model: nn.Module) -> None:
    """Copy the policy's parameters and buffers into the reference model, in place.

    Tensors are copied with ``copy_`` so the reference keeps its own storage, dtype and device (e.g. a bf16
    reference from an fp32 master policy). Nothing touches an optimizer: the policy's optimizer state is left
    as is (ProRL v1 additionally re-initialises it; do that separately if wanted). Raises if the two models do
    not have the same parameter names and shapes.
    """
    for kind, ref_named, pol_named in (
        ("parameter", ref_model.named_parameters(), policy_model.named_parameters()),
        ("buffer", ref_model.named_buffers(), policy_model.named_buffers()),
    ):
        ref_tensors = dict(ref_named)
        pol_tensors = dict(pol_named)
        if ref_tensors.keys() != pol_tensors.keys():
            missing = sorted(ref_tensors.keys() ^ pol_tensors.keys())
            raise ValueError(f"reference and policy {kind} names differ: {missing[:5]}")
        for name, ref_t in ref_tensors.items():
            pol_t = pol_tensors[name]
            if ref_t.shape != pol_t.shape:
                raise ValueError(f"{kind} {name}: shape {tuple(ref_t.shape)} != {tuple(pol_t.shape)}")
            ref_t.copy_(pol_t)
