"""The most lagged ready groups first against stream order (`trainer.oldest_groups_first`), on the ORZ CPU
rehearsal (recipes/orz_cpu.yaml: dynamic sampling, `actor.max_lag: 1`, 48-token answers of varying length).

Groups finish out of the order they started in, so in stream order a group that started a version earlier waits
behind younger ones and can pass `actor.max_lag` before its turn: it is generated, scored and thrown away. Both
runs start from the same base model and train the same number of steps; each reports the share of the samples
it took from the stream that it dropped as stale, and its trained samples per second over the training period.
Ratio: the share of taken samples trained on, oldest first over stream order (target: above 1, fewer samples
wasted).

The base model's supervised warm-up takes minutes on 2 cores: it is cached in runs/bench/orz_cpu/base_model with
the synthetic problems it is warmed up on, and reused while its settings stay the same.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import cached_base_model, machine, verdict
from bench.pipeline_vs_sync import ROOT, launch, step_rows

NAME = "oldest_first"
RECIPE = ROOT / "recipes" / "orz_cpu.yaml"


def stale_share(rows: list[dict]) -> float:
    """Samples dropped as stale over all samples taken from the stream, at the last step."""
    last = step_rows(rows, 0)[-1]
    return last["stale_dropped"] / last["samples_total"]


def trained_per_s(rows: list[dict], skip: int) -> float:
    """Samples trained on per second between the end of step `skip` and the last step."""
    train = step_rows(rows, skip)
    return sum(r["samples"] for r in train[1:]) / (train[-1]["time"] - train[0]["time"])


def run(quick: bool = False) -> dict:
    from pipelinerl.tasks.synthetic_math import write_synthetic_orz

    steps, skip = (30, 5) if quick else (100, 10)
    model = cached_base_model(RECIPE)
    data = model.parent / "data"
    if not (data / "train.json").exists():
        write_synthetic_orz(data)
    common = [f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0", f"model.path={model}",
              f"task.train_data=[{data}/train.json]", f"task.eval_data=[{data}/eval/add.json]"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-") as tmp:
        for label, flag in (("stream order", "false"), ("oldest first", "true")):
            runs[label] = launch(Path(tmp) / flag, common + [f"trainer.oldest_groups_first={flag}"], 3600, RECIPE)
    stale = {label: stale_share(rows) for label, rows in runs.items()}
    speed = {label: trained_per_s(rows, skip) for label, rows in runs.items()}
    ratio = (1 - stale["oldest first"]) / (1 - stale["stream order"])
    return {
        "ratio": ratio,
        "target": 1.0,
        **verdict(ratio, 1.0),
        "summary": f"stale {100 * stale['stream order']:.1f}% -> {100 * stale['oldest first']:.1f}% of samples "
                   f"taken; {speed['stream order']:.3g} -> {speed['oldest first']:.3g} trained samples/s",
        "stale_share": stale,
        "trained_samples_per_s": speed,
        "stale_dropped": {label: step_rows(rows, 0)[-1]["stale_dropped"] for label, rows in runs.items()},
        "samples_taken": {label: step_rows(rows, 0)[-1]["samples_total"] for label, rows in runs.items()},
        "settings": {"recipe": str(RECIPE.relative_to(ROOT)), "steps": steps, "skipped_steps": skip},
        "machine": machine(),
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
