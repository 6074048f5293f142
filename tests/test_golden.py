"""Golden numbers: the per-step losses and gradient norms of a few fp32 CPU trainer steps of a tiny model at seed 0,
for each algorithm, pinned as torchtune pins its recipes' losses. A change anywhere in the loss path (log-probs,
packing, advantages, losses, aggregation, KL, clipping, minibatches, the critic) shows up here as a different number,
not only as a weaker "accuracy rose".

When a change is meant to move them, regenerate the table and say why in the commit:

    .venv/bin/python tests/test_golden.py

The tolerance (relative 1e-3) absorbs the float rounding differences between CPUs (the table was made on an AMD
EPYC; Intel Xeons sum in other orders), not a change of formula.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipelinerl.config import CriticConfig, TrainerConfig
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.samples import Sample

STEPS = 3
ALGORITHMS: dict[str, dict] = {
    "reinforce_is": dict(policy_loss="reinforce_is"),
    "ppo_clip_dual": dict(policy_loss="ppo_clip", clip_ratio_c=3.0, aggregation="token_mean"),
    "decoupled_ppo_minibatches": dict(policy_loss="decoupled_ppo", ppo_minibatches=2, behav_imp_weight_cap=5.0),
    "gspo": dict(policy_loss="gspo"),
    "grpo_kl_loss": dict(policy_loss="ppo_clip", kl_coef=0.05, entropy_coef=0.01, group_std_unbiased=True),
    "rpp_kl_reward": dict(policy_loss="ppo_clip", advantage="reinforce_pp_baseline", whiten_over="tokens",
                          kl_coef=0.05, kl_in_reward=True, overlong_filtering=True),
    "ppo_gae_critic": dict(policy_loss="ppo_clip", advantage="gae", aggregation="token_mean",
                           critic=CriticConfig(lr=1e-3, updates=2)),
}

# fmt: off
GOLDEN: dict[str, list[tuple[float, float]]] = {
    "decoupled_ppo_minibatches": [
        (-0.04742763377726078, 2.813061475753784),
        (0.0915156789124012, 2.7940807342529297),
        (0.03435519151389599, 5.422485828399658),
    ],
    "grpo_kl_loss": [
        (0.5373909845948219, 1.2961300611495972),
        (0.33621809631586075, 3.4914615154266357),
        (0.5064595937728882, 3.169858455657959),
    ],
    "gspo": [
        (0.3962469846010208, 0.41022956371307373),
        (0.24175841361284256, 0.4380764961242676),
        (0.3663216335698962, 0.5694441795349121),
    ],
    "ppo_clip_dual": [
        (0.2737504094839096, 0.5288376808166504),
        (0.17604918591678143, 1.4761768579483032),
        (0.24607641622424126, 1.0482673645019531),
    ],
    "ppo_gae_critic": [
        (0.30853158980607986, 0.5827153921127319),
        (0.1549031399190426, 1.2047979831695557),
        (0.25995355658233166, 1.4616780281066895),
    ],
    "reinforce_is": [
        (0.2681032419204712, 1.8306838274002075),
        (0.4587664157152176, 4.2917304039001465),
        (-0.36386504024267197, 3.7859997749328613),
    ],
    "rpp_kl_reward": [
        (0.6781904697418213, 1.096825122833252),
        (0.5081523754633963, 1.6988515853881836),
        (0.69674988463521, 0.9811757206916809),
    ],
}
# fmt: on


def batches() -> list[list[Sample]]:
    """Three steps of two groups of three; versions, log-probs, lengths and a truncated sample vary."""
    out = []
    for step in range(STEPS):
        samples = []
        for g, prompt in enumerate(([5, 6, 7], [8, 9])):
            for j in range(3):
                output = [10 + 7 * g + 3 * j + k + step for k in range(2 + (j + step) % 3)]
                samples.append(Sample(
                    group_id=f"{step}-{g}", prompt_token_ids=prompt, output_token_ids=output,
                    behav_logprobs=[-2.0 - 0.25 * k - 0.5 * j for k in range(len(output))],
                    versions=[max(0, step - j % 2)] * len(output),
                    finish_reason="length" if (g, j) == (1, 2) else "stop",
                    reward=float((j + g + step) % 2) + 0.1 * j))
        out.append(samples)
    return out


def run(model_dir: str | Path, algorithm: str) -> list[tuple[float, float]]:
    from pipelinerl.trainer import Trainer

    cfg = TrainerConfig(lr=1e-2, samples_per_step=6, micro_batch_tokens=10, grad_clip=1.0, **ALGORITHMS[algorithm])
    trainer = Trainer(str(model_dir), cfg, seed=0)
    numbers = []
    for samples in batches():
        stats = trainer.optimizer_step(samples)
        numbers.append((stats["loss"], stats["grad_norm"]))
    return numbers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("golden"), hidden_size=32, num_layers=1, seed=0,
                            initializer_range=0.1)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_golden_losses_and_gradient_norms(model_dir, algorithm):
    got = run(model_dir, algorithm)
    want = GOLDEN[algorithm]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(want_loss, rel=1e-3, abs=1e-6), (algorithm, step, "loss", got)
        assert norm == pytest.approx(want_norm, rel=1e-3, abs=1e-6), (algorithm, step, "grad_norm", got)


if __name__ == "__main__":  # print a fresh table to paste above
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp), hidden_size=32, num_layers=1, seed=0, initializer_range=0.1)
        names = sys.argv[1:] or sorted(ALGORITHMS)
        for name in names:
            rows = "".join(f"        ({loss!r}, {norm!r}),\n" for loss, norm in run(path, name))
            print(f'    "{name}": [\n{rows}    ],')
