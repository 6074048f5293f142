"""Where RL algorithms plug in: policy losses and advantage estimators register themselves under a name.

As in verl's ``core_algos.py``, a new algorithm is one decorated function, in ``pipelinerl/rl/losses.py`` /
``pipelinerl/rl/advantages.py`` or in a file of your own, and nothing else changes: the config validates
``trainer.policy_loss`` / ``trainer.advantage`` against this registry, and the trainer calls every loss and every
estimator the same way. A name of the form ``package.module:function`` imports that module first, so a recipe can
name a function that is not part of this package (decorated or not)::

    from pipelinerl.rl.registry import LossInputs, register_policy_loss

    @register_policy_loss("my_loss", clip=(0.2, 0.2), aggregation="token_mean")
    def my_loss(logprobs, inputs: LossInputs, cfg):
        ratio = (logprobs - inputs.old_logprobs).exp()
        loss = -(ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * inputs.advantages)
        return loss.where(inputs.mask, 0.0), {}

and ``trainer.policy_loss: my_package.my_module:my_loss`` in the recipe. If your loss and its gradient are 0 on
every token whose advantage is 0, register it with ``zero_without_advantage=True``: the trainer then leaves such
samples out of its passes (``trainer.skip_zero_advantage``), as it does for the built-in losses.
Hyper-parameters of your own go in ``trainer.policy_loss_args`` (a mapping, passed as ``cfg.policy_loss_args`` to a
loss that declares it reads it, or declares nothing).

The calls:

* a policy loss is ``fn(logprobs [T], inputs: LossInputs, cfg) -> (per_token_loss [T], stats)``, ``cfg``
  holding the trainer settings the loss declared in ``reads`` and no others (``settings_for``; all of
  TrainerConfig if it declares none), ``logprobs`` carrying the gradient; the loss is 0 off ``inputs.mask`` and
  the trainer reduces it with ``losses.aggregate`` as ``trainer.aggregation`` says (the loss's own default);
* an advantage estimator is ``fn(inputs: AdvantageInputs, cfg) -> advantages [N]`` (``cfg`` as for a loss), one
  per sample, which the trainer puts on every output token of the sample. A ``token_level`` estimator (GAE) is
  computed by the trainer from per-token rewards and the critic's values instead; its ``fn`` is not called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pipelinerl.plugins import ADVANTAGES, POLICY_LOSSES

if TYPE_CHECKING:
    from torch import Tensor

AGGREGATIONS = ("token_sum_norm", "token_mean", "seq_mean")


@dataclass
class LossInputs:
    """What a policy loss sees of one packed micro-batch besides the current log-probs; every tensor is ``[T]``.

    ``old_logprobs`` is the policy the trust region is taken around: the behaviour policy's (the engine's) for a
    loss that does not need a proximal one, the proximal policy's (the trainer's weights before this batch's first
    update) for one that does (``needs_proximal``).
    """

    mask: Tensor  # bool, True on the tokens trained on
    advantages: Tensor
    behav_logprobs: Tensor  # the engine's log-probs of the sampled tokens
    old_logprobs: Tensor
    prox_logprobs: Tensor | None  # None unless the loss needs_proximal or trainer.ppo_minibatches > 1
    seq_ids: Tensor  # long, the sequence each token belongs to


@dataclass
class AdvantageInputs:
    """One entry per sample of the whole step, ``[N]``."""

    rewards: Tensor  # float; with trainer.kl_in_reward, minus kl_coef times the sample's summed KL
    group_ids: Tensor  # long, dense labels of the prompt groups
    lengths: Tensor  # float, the tokens of each sample that are trained on (for token-level whitening)


# The trainer settings that belong to one algorithm or another. Each registered loss and estimator declares the
# ones it reads (`reads`); a recipe that sets one the chosen algorithm does not read gets a config error naming the
# key, instead of a run that silently ignores it (TrainerConfig checks this against `reads_key`).
ALGORITHM_KEYS = ("clip_low", "clip_high", "clip_ratio_c", "behav_imp_weight_cap", "importance_sampling_level",
                  "is_cap", "group_std_unbiased", "whiten_over", "policy_loss_args", "critic")


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    needs_proximal: bool = False  # ratios against the policy before the first update of the batch (AReaL)
    clip: tuple[float, float] = (0.2, 0.28)  # default (trainer.clip_low, trainer.clip_high)
    aggregation: str = "token_sum_norm"  # default trainer.aggregation
    # The loss and its gradient are 0 on every token whose advantage is 0, so the trainer may leave a sample with
    # advantage 0 out of its forward and backward passes (trainer.skip_zero_advantage). False for a loss of your
    # own unless it says so: a term that does not scale with the advantage would be silently dropped.
    zero_without_advantage: bool = False
    # the ALGORITHM_KEYS of trainer.* this loss reads; None (a loss of your own that does not say): not checked
    reads: tuple[str, ...] | None = None
    # values for settings the recipe leaves unset (None), e.g. decoupled PPO's behaviour-weight cap
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdvantageSpec:
    name: str
    fn: Callable[..., Tensor] | None
    token_level: bool = False  # needs the critic's per-token values (trainer.critic)
    reads: tuple[str, ...] | None = None  # as PolicyLossSpec.reads
    # The estimator's output is normalised over the whole batch (std 1, over samples or tokens: trainer.whiten_over)
    # by the trainer, after it: `fn` returns the centred advantages. With trainer.kl_reward: to_go the per-token KL
    # enters between the two, as in OpenRLHF's REINFORCE++.
    whitened: bool = False


def settings_for(spec: PolicyLossSpec | AdvantageSpec, cfg: Any) -> Any:
    """The trainer settings an algorithm is called with: the ones it declared it reads (`reads`), and no others, so
    that a loss reading a setting it did not declare fails at its first call instead of being silently exempt
    from the config's checks. An algorithm that declares nothing gets the whole TrainerConfig."""
    if spec.reads is None:
        return cfg
    return SimpleNamespace(**{key: getattr(cfg, key) for key in spec.reads})


def reads_key(spec: PolicyLossSpec | AdvantageSpec, key: str) -> bool:
    """Whether the algorithm reads `trainer.<key>` (an algorithm that does not declare its keys reads any)."""
    return spec.reads is None or key in spec.reads


def register_policy_loss(name: str, *, needs_proximal: bool = False, clip: tuple[float, float] = (0.2, 0.28),
                         aggregation: str = "token_sum_norm", zero_without_advantage: bool = False,
                         reads: Sequence[str] | None = None, defaults: Mapping[str, Any] | None = None
                         ) -> Callable:
    """Decorator: make ``fn`` the policy loss ``trainer.policy_loss: name``. ``reads``: the trainer settings of
    ``ALGORITHM_KEYS`` it uses (unset: not checked); ``defaults``: values for those the recipe leaves unset."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy loss {name!r}: aggregation must be one of {', '.join(AGGREGATIONS)}")
    _check_keys(name, reads, defaults)

    def add(fn: Callable) -> Callable:
        spec = PolicyLossSpec(name, fn, needs_proximal, tuple(clip), aggregation, zero_without_advantage,
                              None if reads is None else tuple(reads), dict(defaults or {}))
        POLICY_LOSSES.add(name, spec)
        fn.policy_loss_spec = spec
        return fn

    return add


def register_advantage(name: str, *, token_level: bool = False, reads: Sequence[str] | None = None,
                       whitened: bool = False) -> Callable:
    """Decorator: make ``fn`` the advantage estimator ``trainer.advantage: name``."""
    _check_keys(name, reads, None)

    def add(fn: Callable) -> Callable:
        spec = AdvantageSpec(name, fn, token_level, None if reads is None else tuple(reads), whitened)
        ADVANTAGES.add(name, spec)
        fn.advantage_spec = spec
        return fn

    return add


def _check_keys(name: str, reads: Sequence[str] | None, defaults: Mapping[str, Any] | None) -> None:
    unknown = [k for k in [*(reads or ()), *(defaults or {})] if k not in ALGORITHM_KEYS]
    if unknown:
        raise ValueError(f"{name!r}: {unknown} are not algorithm settings ({', '.join(ALGORITHM_KEYS)})")
    missing = [k for k in (defaults or {}) if reads is not None and k not in reads]
    if missing:
        raise ValueError(f"{name!r}: defaults for {missing}, which it does not read")


def policy_loss(name: str) -> PolicyLossSpec:
    """The registered loss ``name``, or the function at ``package.module:function``. KeyError
    (pipelinerl.plugins.UnknownPlugin) says what exists."""
    found = POLICY_LOSSES.get(name)
    if isinstance(found, PolicyLossSpec):
        return found
    return getattr(found, "policy_loss_spec", None) or PolicyLossSpec(name, found)


def advantage(name: str) -> AdvantageSpec:
    """The registered estimator ``name``, or the function at ``package.module:function``."""
    found = ADVANTAGES.get(name)
    if isinstance(found, AdvantageSpec):
        return found
    return getattr(found, "advantage_spec", None) or AdvantageSpec(name, found)


def readers(key: str) -> list[str]:
    """The registered losses and estimators that read `trainer.<key>`, for error messages."""
    specs = [spec for _, spec in [*POLICY_LOSSES.items(), *ADVANTAGES.items()]]
    return sorted(s.name for s in specs if s.reads is not None and key in s.reads)


def policy_loss_names() -> list[str]:
    return POLICY_LOSSES.names()


def advantage_names() -> list[str]:
    return ADVANTAGES.names()
