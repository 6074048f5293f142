"""The RL algorithms side by side on the tiny recipe: `make compare-algorithms` (or `python -m bench.algorithms
[--steps N] [--only NAME,...]`).

Each algorithm runs the same recipe (`recipes/tiny_cpu.yaml`: same seed, same warmed-up base model, same budget of
RL steps) with only its own settings overridden, and is evaluated on the held-out problems before, midway and
after. Writes bench/results/algorithms.json, bench/results/algorithms.png (held-out accuracy and training reward
of every run against time and samples) and prints a Markdown table for docs/algorithms.md.

One run per algorithm at one seed on a tiny task: the table shows that each one learns and what its own numbers
(clip fractions, the critic's loss) look like, not which algorithm is better at scale.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import RESULTS_DIR, machine, run_comparison
from bench.pipeline_vs_sync import ROOT, launch

# name -> the overrides of recipes/tiny_cpu.yaml that make it that algorithm
ALGORITHMS: dict[str, list[str]] = {
    "ppo_clip + grpo (recipe)": [],
    "reinforce_is + grpo (PipelineRL)": ["trainer.policy_loss=reinforce_is"],
    "decoupled_ppo, 2 minibatches (AReaL)": ["trainer.policy_loss=decoupled_ppo", "trainer.ppo_minibatches=2",
                                             "trainer.behav_imp_weight_cap=5.0"],
    "gspo": ["trainer.policy_loss=gspo"],
    "ppo_clip + reinforce_pp_baseline (ProRL)": ["trainer.advantage=reinforce_pp_baseline"],
    "ppo_clip + dual-clip + overlong filtering": ["trainer.clip_ratio_c=3.0", "trainer.overlong_filtering=true"],
    "ppo + critic, gae (ORZ)": ["trainer.advantage=gae", "trainer.critic.lr=1e-4", "trainer.critic.updates=4",
                                "actor.dynamic_sampling=false"],
}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(rows: list[dict]) -> dict:
    """The numbers of one run: held-out accuracy at each evaluation, training reward, time, the clip and critic
    statistics over the first and last tenth of the steps."""
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "reward_mean" in r]
    tenth = max(1, len(steps) // 10)
    head, tail = steps[:tenth], steps[-tenth:]

    for r in steps:
        if "clip_low_frac" in r:  # tokens clipped on either side of the trust region
            r["clip_frac"] = r["clip_low_frac"] + r.get("clip_high_frac", 0.0)
        if "critic_returns_var" in r:  # the critic's loss over that of values all 0 (1 at the first step)
            zero_values_loss = 0.5 * (r["critic_returns_var"] + r["critic_returns_mean"] ** 2)
            r["critic_loss_vs_zero_values"] = r["critic_loss"] / zero_values_loss if zero_values_loss else None

    def both(key: str) -> list[float | None]:
        return [_mean([r[key] for r in part if key in r]) for part in (head, tail)]

    return {
        "eval_accuracy": [(r["step"], r["eval_accuracy"]) for r in evals],
        "reward_mean_first_last_tenth": both("reward_mean"),
        "clip_frac_first_last_tenth": both("clip_frac"),
        "critic_loss_first_last_tenth": both("critic_loss"),
        "critic_loss_vs_zero_values_first_last_tenth": both("critic_loss_vs_zero_values"),
        "critic_explained_var_first_last_tenth": both("critic_explained_var"),
        "train_seconds": steps[-1]["time"] if steps else None,
        "steps": len(steps),
    }


def _cell(pair: list[float | None]) -> str:
    return "" if pair[0] is None else f"{pair[0]:.3f} -> {pair[1]:.3f}"


def _critic(r: dict) -> str:
    loss, ratio = r["critic_loss_first_last_tenth"], r["critic_loss_vs_zero_values_first_last_tenth"]
    return "" if loss[0] is None else f"{_cell(loss)} ({_cell(ratio)})"


def table(results: dict[str, dict]) -> str:
    lines = ["| algorithm | held-out pass@1 (steps) | training reward, first -> last tenth | clip fraction | "
             "critic loss (vs zero values) | critic explained variance | training seconds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        evals = " -> ".join(f"{acc:.3f}" for _, acc in r["eval_accuracy"])
        at = "/".join(str(step) for step, _ in r["eval_accuracy"])
        lines.append(f"| {name} | {evals} ({at}) | {_cell(r['reward_mean_first_last_tenth'])} | "
                     f"{_cell(r['clip_frac_first_last_tenth'])} | {_critic(r)} | "
                     f"{_cell(r['critic_explained_var_first_last_tenth'])} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def compare(steps: int, names: list[str], out_dir: Path = RESULTS_DIR) -> dict:
    from pipelinerl.plot import plot_comparison

    runs_root = ROOT / "runs" / "algorithms"
    # one warmed-up base model for every run, so each starts from the same weights and none pays the warm-up
    common = [f"model.path={runs_root / 'base_model'}", f"trainer.max_steps={steps}",
              f"trainer.eval_every={max(1, steps // 2)}", "trainer.save_every=0"]
    results, dirs = {}, {}
    for name in names:
        run_dir = runs_root / name.split(" ")[0].replace(",", "") / str(len(dirs))
        print(f"== {name}: {' '.join(ALGORITHMS[name]) or '(the recipe as it is)'}", flush=True)
        t0 = time.perf_counter()
        rows = launch(run_dir, common + ALGORITHMS[name])
        results[name] = {"overrides": ALGORITHMS[name], **summarise(rows)}
        dirs[name] = run_dir
        print(f"   {time.perf_counter() - t0:.0f} s; held-out pass@1 {results[name]['eval_accuracy']}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_comparison(dirs, out_dir / "algorithms.png")
    out = {"steps": steps, "recipe": "recipes/tiny_cpu.yaml", "results": results, "png": str(png),
           "machine": machine()}
    (out_dir / "algorithms.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="RL steps per algorithm (default 150)")
    parser.add_argument("--only", default="", help="comma-separated names, as listed in ALGORITHMS")
    args = parser.parse_args(argv)
    return run_comparison(parser, args.only, list(ALGORITHMS), lambda names: compare(args.steps, names), table)


if __name__ == "__main__":
    raise SystemExit(main())
