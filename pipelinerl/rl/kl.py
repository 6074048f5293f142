"""KL penalty estimators and ProRL-style reference-policy resets."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class ReferenceResetPolicy:
    """When to hard-reset the KL reference policy to the current policy (ProRL v2).

    A KL penalty against a fixed reference eventually dominates the loss and stalls learning; ProRL resets the
    reference to the online policy periodically and whenever the measured KL spikes.

    ``should_reset(step, kl_value)`` is True when ``every_n_steps`` steps have passed since the last reset
    (the start of training counts as a reset at step 0), or when ``kl_value`` exceeds ``kl_threshold``.
    Either criterion may be None (disabled). A True answer is recorded as a reset at ``step``, so the caller
    is expected to act on it (e.g. with :func:`reset_reference`).
    """

    every_n_steps: int | None = None
    kl_threshold: float | None = None
    last_reset_step: int = 0

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be positive or None, got {self.every_n_steps}")

    def should_reset(self, step: int, kl_value: float | Tensor | None = None) -> bool:
        periodic = self.every_n_steps is not None and step - self.last_reset_step >= self.every_n_steps
        spiked = (
            self.kl_threshold is not None and kl_value is not None and float(kl_value) > self.kl_threshold
        )
        if periodic or spiked:
            self.last_reset_step = step
            return True
        return False


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
