"""The RL algorithms side by side on the tiny recipe: `make compare-algorithms` (or `python -m bench.algorithms
[--steps N] [--only NAME,...]`).

Each algorithm runs the same recipe (`recipes/tiny_cpu.yaml`: same seed, same warmed-up base model, same budget of
RL steps) with only its own settings overridden, and is evaluated on the held-out problems before, midway and
after. Writes bench/results/algorithms.json, bench/results/algorithms.png (held-out accuracy and training reward
of every run against time and samples) and prints a Markdown table for docs/algorithms.md.

One run per algorithm at one seed on a tiny task: the table shows that each one learns and what its own numbers
(clip fractions, the critic's loss) look like, not which algorithm is better at scale.

`--presets [--seeds N]` (`make compare-presets`) runs the papers' presets instead (`recipes/presets/`: orz,
prorl_v2, dapo, areal, pipelinerl, gspo), each loaded onto the tiny recipe as a user loads it (`preset=NAME`), N
seeds each (3 by default), every run from the same base model. The presets' learning rates and batch shapes are
those of 7B-scale runs (ORZ's 1e-6, 8,192 samples a step), which a tiny model on 2 cores cannot use: each runs
its method (loss, clip range, advantage estimator, aggregation, critic updates, dynamic sampling, max_lag, caps)
at the recipe's scale (`PRESET_SCALE`: its learning rate and warm-up, 64 samples a step in groups of 8; a critic
at 5x the policy's learning rate, ORZ's ratio). Writes bench/results/presets.{json,png} (the held-out curves' mean
and spread per preset).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
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


PRESETS = ("orz", "prorl_v2", "dapo", "areal", "pipelinerl", "gspo")
# the tiny recipe's scale, kept under every preset (see the module docstring); a critic only where there is one
PRESET_SCALE = ["trainer.lr=7e-4", "trainer.warmup_steps=10", "trainer.samples_per_step=64", "sampling.group_size=8"]
PRESET_CRITIC_SCALE = ["trainer.critic.lr=3.5e-3", "trainer.critic.warmup_updates=20"]


def preset_overrides(name: str) -> list[str]:
    return [f"preset={name}", *PRESET_SCALE, *(PRESET_CRITIC_SCALE if name == "orz" else [])]


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


def compare_presets(steps: int, names: list[str], seeds: int, out_dir: Path = RESULTS_DIR) -> dict:
    """Every preset in `names` at `seeds` seeds (seed by seed: a shortened run still compares them on one set)."""
    runs_root = ROOT / "runs" / "presets"
    common = [f"model.path={ROOT / 'runs' / 'algorithms' / 'base_model'}", "model.seed=0",
              f"trainer.max_steps={steps}", f"trainer.eval_every={max(1, steps // 3)}", "trainer.save_every=0",
              "trainer.save_every_minutes=0"]
    results: dict[str, dict] = {name: {"overrides": preset_overrides(name), "runs": []} for name in names}
    for seed in range(seeds):
        for name in names:
            run_dir = runs_root / name / f"seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short would resume from its checkpoint
            t0 = time.perf_counter()
            rows = launch(run_dir, [*common, *preset_overrides(name), f"seed={seed}"])
            results[name]["runs"].append({"seed": seed, **summarise(rows)})
            print(f"== {name} seed {seed}: {time.perf_counter() - t0:.0f} s; held-out "
                  f"{results[name]['runs'][-1]['eval_accuracy']}", flush=True)
    for r in results.values():
        ends = [run["eval_accuracy"][-1][1] for run in r["runs"]]
        r["held_out_end_mean"] = statistics.mean(ends)
        r["held_out_end_sd"] = statistics.stdev(ends) if len(ends) > 1 else 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_presets(results, out_dir / "presets.png")
    out = {"steps": steps, "seeds": seeds, "recipe": "recipes/tiny_cpu.yaml", "scale": PRESET_SCALE,
           "results": results, "png": str(png), "machine": machine()}
    (out_dir / "presets.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def plot_presets(results: dict[str, dict], out: Path) -> Path:
    """Held-out accuracy against steps: each preset's mean over its seeds, its range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(results.items()):
        curves = [dict(run["eval_accuracy"]) for run in r["runs"]]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = [[c[s] for c in curves] for s in steps]
        ax.plot(steps, [statistics.mean(v) for v in values], marker="o", color=f"C{i}",
                label=f"{name} ({len(curves)} seeds)")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.15)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out pass@1")
    ax.set_title("the papers' presets on the tiny recipe, at its scale: mean and range over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _mean_pair(runs: list[dict], key: str) -> str:
    """A first -> last pair's mean over the runs that have it."""
    pairs = [run[key] for run in runs if run[key][0] is not None]
    return "" if not pairs else _cell([statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)])


def presets_table(results: dict[str, dict]) -> str:
    lines = ["| preset | seeds | held-out pass@1 at the end (mean ± sd) | per seed, start -> end | training reward, "
             "first -> last tenth (mean) | clip fraction, first -> last tenth (mean) | training seconds (mean) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        runs = r["runs"]
        per_seed = "; ".join(f"{run['eval_accuracy'][0][1]:.3f} -> {run['eval_accuracy'][-1][1]:.3f}" for run in runs)

        seconds = statistics.mean(run["train_seconds"] for run in runs)
        lines.append(f"| {name} | {len(runs)} | {r['held_out_end_mean']:.3f} ± {r['held_out_end_sd']:.3f} | "
                     f"{per_seed} | {_mean_pair(runs, 'reward_mean_first_last_tenth')} | "
                     f"{_mean_pair(runs, 'clip_frac_first_last_tenth')} | {seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="RL steps per algorithm (default 150)")
    parser.add_argument("--only", default="", help="comma-separated names, as listed in ALGORITHMS (or PRESETS)")
    parser.add_argument("--presets", action="store_true", help="the papers' presets instead, several seeds each")
    parser.add_argument("--seeds", type=int, default=3, help="with --presets: seeds per preset (default 3)")
    args = parser.parse_args(argv)
    if args.presets:
        return run_comparison(parser, args.only, list(PRESETS),
                              lambda names: compare_presets(args.steps, names, args.seeds), presets_table)
    return run_comparison(parser, args.only, list(ALGORITHMS), lambda names: compare(args.steps, names), table)


if __name__ == "__main__":
    raise SystemExit(main())
