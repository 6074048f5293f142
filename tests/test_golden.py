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

import dataclasses
import sys
from pathlib import Path

import pytest

from pipelinerl.config import CriticConfig, TrainerConfig, load_config, preset_names
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
    "rpp_kl_to_go": dict(policy_loss="ppo_clip", advantage="reinforce_pp_baseline", whiten_over="tokens",
                         kl_coef=0.05, kl_in_reward=True, kl_reward="to_go"),
    # every preset of recipes/presets/ as a user loads it (`preset=NAME`), at this test's learning rate and batch
    **{f"preset_{name}": {} for name in preset_names()},
}

# fmt: off
GOLDEN: dict[str, list[tuple[float, float]]] = {
    "decoupled_ppo_minibatches": [
        (-0.04742762632668018, 2.813061475753784),
        (0.09151586331427097, 2.7940807342529297),
        (0.034355221316218376, 5.4224853515625),
    ],
    "grpo_kl_loss": [
        (0.5373909845948219, 1.2961300611495972),
        (0.3362181968986988, 3.4914610385894775),
        (0.5064595900475979, 3.1698577404022217),
    ],
    "gspo": [
        (-0.012083157896995544, 0.5325594544410706),
        (-0.04884609021246433, 1.2471238374710083),
        (0.05537208914756775, 1.3691929578781128),
    ],
    "ppo_clip_dual": [
        (0.2737504094839096, 0.5288376808166504),
        (0.17604914121329784, 1.4761773347854614),
        (0.24607634916901588, 1.0482676029205322),
    ],
    "ppo_gae_critic": [
        (0.30853158980607986, 0.5827154517173767),
        (0.1553790345788002, 1.1995147466659546),
        (0.25900697335600853, 1.4742597341537476),
    ],
    "preset_areal": [
        (0.005802737548947334, 1.3404569625854492),
        (-0.018120947293937206, 1.340882658958435),
        (0.03557815169915557, 0.9535840153694153),
    ],
    "preset_dapo": [
        (0.2737504094839096, 0.5288376808166504),
        (0.1761998701840639, 1.473669409751892),
        (0.2459023930132389, 1.045086145401001),
    ],
    "preset_gspo": [
        (-0.012083157896995544, 0.5325594544410706),
        (-0.04884609021246433, 1.2471238374710083),
        (0.05537208914756775, 1.3691929578781128),
    ],
    "preset_orz": [
        (0.30853158980607986, 0.5827154517173767),
        (0.1621815674006939, 1.2286083698272705),
        (0.25401228852570057, 1.4795398712158203),
    ],
    "preset_pipelinerl": [
        (0.19240066409111023, 1.313765525817871),
        (0.3291532136499882, 3.0795087814331055),
        (-0.23596026748418808, 2.6643946170806885),
    ],
    "preset_prorl_v2": [
        (0.2918602116405964, 0.44635772705078125),
        (0.1918601132929325, 1.0360023975372314),
        (0.2468757089227438, 0.6920399069786072),
    ],
    "reinforce_is": [
        (0.2681032419204712, 1.8306838274002075),
        (0.45876603573560715, 4.29172945022583),
        (-0.3638654053211212, 3.7860000133514404),
    ],
    "rpp_kl_reward": [
        (0.6781904697418213, 1.096825122833252),
        (0.5081523754633963, 1.6988515853881836),
        (0.6967498995363712, 0.9811756610870361),
    ],
    "rpp_kl_to_go": [
        (0.8710528910160065, 1.594628095626831),
        (0.40014330483973026, 4.312903881072998),
        (0.613096322864294, 4.0505499839782715),
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

    common = dict(lr=1e-2, samples_per_step=6, micro_batch_tokens=10, grad_clip=1.0)
    if algorithm.startswith("preset_"):
        preset = load_config(overrides=[f"preset={algorithm.removeprefix('preset_')}", "run_dir=unused",
                                        "model.path=unused"]).trainer
        # no warm-up: three steps at a real learning rate, each visible in the numbers
        gae = preset.advantage == "gae"
        critic = {"critic": dataclasses.replace(preset.critic, lr=1e-3, warmup_updates=0)} if gae else {}
        cfg = dataclasses.replace(preset, **common, warmup_steps=0, schedule="constant", **critic)
    else:
        cfg = TrainerConfig(**common, **ALGORITHMS[algorithm])
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
