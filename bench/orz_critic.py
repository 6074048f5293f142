"""Why PPO with a critic collapsed in the ORZ rehearsal: `make compare-critic` (or `python -m bench.orz_critic
[--seeds N] [--steps N] [--only ARM,...]`).

`recipes/orz_cpu.yaml` (ORZ's prompt, stop strings and reward on a tiny model) for `--steps` RL steps, synchronous
(`actor.max_lag=0`, so that a run's samples depend on its seed alone), every run from one warmed-up base model,
`--seeds` seeds per arm (6 by default), two runs side by side (`--parallel`). The arms (issue 48) change one thing
at a time against A:

* A: PPO-clip with the critic as the rehearsal had it (critic lr 1e-4, 4 updates of contiguous slices in packing
  order, no warm-up), dynamic sampling off;
* B: A with a critic that cannot learn (lr 1e-30: V stays at the zero-initialised head's 0), i.e. whitened
  returns, a global baseline;
* C: REINFORCE++-baseline (group mean, normalised over the batch) instead of the critic, dynamic sampling off;
* D: A with dynamic sampling on;
* G: the critic as ORZ trains it, fitted first, at a quarter of the policy's learning rate: policy lr 2.5e-4
  (the rehearsal's 1e-3 then), critic 5x that (ORZ: 5e-6 against 1e-6) with a linear warm-up over its first 20 updates,
  shuffled updates, the policy frozen for the first 5 steps while the critic fits (verl's critic_warmup);
* H: the recipe as it shipped then (REINFORCE++-baseline with dynamic sampling), synchronous as every arm here;
* I: A at G's policy learning rate, its critic unchanged: the learning rate alone;
* J: C at that learning rate: the strongest baseline without a critic at the same learning rate;
* R: `recipes/orz_cpu.yaml` (gae, its critic at 5x the policy's learning rate with shuffled updates and a warm-up,
  dynamic sampling on) at the policy lr of 5e-4 it shipped with until S measured better, synchronous;
* S: R at I's policy learning rate, 2.5e-4, its critic still at 5x: the recipe as it ships now.

Every arm but R and S changes the rehearsal as it was when the collapse was seen (REINFORCE++-baseline, policy lr 1e-3,
no critic settings: `BENCH_BASE`, written to runs/orz_critic/orz_cpu_bench.yaml), not the shipped recipe.

Arms run seed by seed (seed 0 of every arm, then seed 1, ...), so that a shortened run still compares them on the
same seeds; a run already finished in runs/orz_critic is read back, not run again.

Per run: held-out avg@4 over the three benchmarks before and after, the policy's own accuracy on its training
problems (every group, kept or dropped: `generated_accuracy`) over the first and last fifth of the run. Writes
bench/results/orz_critic.{json,png} and prints the table for docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import RESULTS_DIR, machine
from bench.pipeline_vs_sync import ROOT, launch

RECIPE = ROOT / "recipes" / "orz_cpu.yaml"
# The arms are changes to the rehearsal as it stood when the collapse was seen, written out here so that they stay
# the same experiment whatever the shipped recipe becomes: REINFORCE++-baseline at a policy lr of 1e-3, no critic
# settings (`bench_recipe`); arms R and S are the shipped recipe at two learning rates.
BENCH_BASE = {"trainer.lr": 1e-3, "trainer.advantage": "reinforce_pp_baseline"}
CRITIC_A = ["trainer.advantage=gae", "trainer.critic.lr=1e-4", "trainer.critic.updates=4",
            "trainer.critic.shuffle=false", "actor.dynamic_sampling=false"]
ARMS: dict[str, list[str]] = {
    "A": CRITIC_A,
    "B": [*CRITIC_A, "trainer.critic.lr=1e-30"],
    "C": ["trainer.advantage=reinforce_pp_baseline", "actor.dynamic_sampling=false"],
    "D": [*CRITIC_A, "actor.dynamic_sampling=true"],
    "G": [*CRITIC_A, "trainer.lr=2.5e-4", "trainer.critic.shuffle=true", "trainer.critic.lr=1.25e-3",
          "trainer.critic.warmup_updates=20", "trainer.critic.policy_frozen_steps=5"],
    "H": ["actor.dynamic_sampling=true"],
    "I": [*CRITIC_A, "trainer.lr=2.5e-4"],
    "J": ["trainer.advantage=reinforce_pp_baseline", "actor.dynamic_sampling=false", "trainer.lr=2.5e-4"],
    # recipes/orz_cpu.yaml (synchronous, as every arm here) at the learning rates it shipped with until arm S
    # measured best, and at those it ships with now: both named, so the arms stay what they were measured as
    "R": ["trainer.lr=5e-4", "trainer.critic.lr=2.5e-3"],
    "S": ["trainer.lr=2.5e-4", "trainer.critic.lr=1.25e-3"],  # R at I's policy lr, its critic still 5x
}
SHIPPED_ARMS = ("R", "S")  # arms that change the shipped recipe, not the rehearsal of BENCH_BASE
DESCRIPTION = {
    "A": "gae, critic lr 1e-4, 4 contiguous updates (the rehearsal's)",
    "B": "gae with V = 0 (critic lr 1e-30)",
    "C": "reinforce_pp_baseline",
    "D": "A with dynamic sampling",
    "G": "gae fitted first at policy lr 2.5e-4: critic 1.25e-3, 20 warm-up updates, shuffled, policy frozen 5 steps",
    "H": "reinforce_pp_baseline with dynamic sampling (the recipe then)",
    "I": "A at G's policy lr 2.5e-4 (critic as A)",
    "J": "C at policy lr 2.5e-4",
    "R": "the recipe at policy lr 5e-4: gae, critic 2.5e-3 shuffled, 20 warm-up updates, dynamic sampling",
    "S": "R at policy lr 2.5e-4, critic 1.25e-3 (the recipe as it ships)",
}


def bench_recipe(root: Path) -> Path:
    """recipes/orz_cpu.yaml with the algorithm of the rehearsal the arms change (BENCH_BASE, no `trainer.critic`),
    written under `root`: every arm but R starts from it."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(RECIPE)
    cfg.trainer.pop("critic", None)
    for key, value in BENCH_BASE.items():
        OmegaConf.update(cfg, key, value)
    path = root / "orz_cpu_bench.yaml"
    root.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)
    return path


def prepare(root: Path) -> tuple[Path, Path]:
    """The synthetic ORZ problems and one warmed-up base model (built by a one-step run) that every run starts
    from."""
    from pipelinerl.tasks.synthetic_math import write_synthetic_orz

    data = root / "data"
    if not (data / "train.json").exists():
        write_synthetic_orz(data)
    base = root / "base_model"
    if not (base / "config.json").exists():
        launch(root / "warmup", [*data_overrides(data), f"model.path={base}", "trainer.max_steps=1",
                                 "trainer.eval_every=0", "trainer.save_every=0"], recipe=RECIPE)
    return data, base


def data_overrides(data: Path) -> list[str]:
    return [f"task.args.train_data=[{data}/train.json]",
            f"task.args.eval_data=[{data}/eval/add.json,{data}/eval/sub.json,{data}/eval/choice.json]"]


def generated_accuracy(run_dir: Path) -> tuple[float, float]:
    """The policy's accuracy on its training problems over about the first and the last fifth of the samples it
    generated (every group, kept or dropped: under dynamic sampling the trainer's batch holds only the kept ones),
    from the actor's cumulative counts (actor_metrics.jsonl, a row every 5 s)."""
    rows = [json.loads(line) for line in (run_dir / "actor_metrics.jsonl").read_text().splitlines()]
    counts = [(r["samples_generated"], r["samples_generated_correct"]) for r in rows if r["samples_generated"]]
    total, correct = counts[-1]
    n1, c1 = next((n, c) for n, c in counts if n >= total / 5)
    n2, c2 = next((n, c) for n, c in counts if n >= 0.8 * total)
    return c1 / n1, (correct - c2) / max(total - n2, 1)


def summarise(rows: list[dict], run_dir: Path) -> dict:
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "reward_mean" in r]
    first, last = generated_accuracy(run_dir)
    explained = [s["critic_explained_var"] for s in steps[-max(1, len(steps) // 5):] if "critic_explained_var" in s]
    return {
        "eval_first": evals[0]["eval_accuracy"], "eval_last": evals[-1]["eval_accuracy"],
        "train_accuracy_first": first, "train_accuracy_last": last,
        "critic_explained_var_last": sum(explained) / len(explained) if explained else None,
        "seconds": steps[-1]["time"], "steps": len(steps),
    }


def run_arms(arms: list[str], seeds: int, steps: int, root: Path, parallel: int = 2) -> dict:
    data, base = prepare(root)
    recipe = bench_recipe(root)
    # model.seed 0: the run's seed would otherwise select (and build, over the shared one) a base model of its own
    common = [*data_overrides(data), f"model.path={base}", "model.seed=0", f"trainer.max_steps={steps}",
              f"trainer.eval_every={steps}", "trainer.save_every=0", "trainer.save_every_minutes=0",
              "actor.max_lag=0"]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    out_path = RESULTS_DIR / "orz_critic.json"

    def one(seed: int, arm: str) -> dict:
        run_dir = root / arm / f"seed{seed}"
        t0 = time.perf_counter()
        metrics = run_dir / "metrics.jsonl"
        try:
            rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            done = sum("reward_mean" in r for r in rows) >= steps and any(
                r.get("step") == steps and "eval_accuracy" in r for r in rows)
            if not done:
                shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short would resume from its checkpoint
                rows = launch(run_dir, [*common, *ARMS[arm], f"seed={seed}"],
                              recipe=RECIPE if arm in SHIPPED_ARMS else recipe, timeout_s=3600)
            result = {"seed": seed, **summarise(rows, run_dir)}
        except RuntimeError as e:
            result = {"seed": seed, "failed": str(e)[-500:]}
        print(f"{arm} seed {seed}: {time.perf_counter() - t0:.0f} s; {result}", flush=True)
        return result

    # With actor.max_lag 0 a run alternates between generating and training, about one core busy at a time: two
    # runs side by side keep both cores busy. Seed by seed, so a shortened run still compares arms on one seed set.
    jobs = [(seed, arm) for seed in range(seeds) for arm in arms]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for (_, arm), result in zip(jobs, pool.map(lambda job: one(*job), jobs)):
            results[arm].append(result)
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)  # written after every run: a long job keeps what it did
            out_path.write_text(json.dumps({"steps": steps, "recipe": str(RECIPE.relative_to(ROOT)), "arms": ARMS,
                                            "results": results, "machine": machine()}, indent=1) + "\n")
    return results


def _spread(values: list[float]) -> str:
    if not values:
        return ""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f} (min {min(values):.3f})"


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| arm | runs | held-out avg@4, start -> end (mean ± sd, min) | runs whose held-out fell > 0.05 | "
             "training accuracy, first -> last fifth | critic explained variance, last fifth |",
             "| --- | --- | --- | --- | --- | --- |"]
    for arm, runs in results.items():
        ok = [r for r in runs if "failed" not in r]
        start = _spread([r["eval_first"] for r in ok])  # the same base model: the same start in every run
        end = _spread([r["eval_last"] for r in ok])
        fell = sum(r["eval_last"] < r["eval_first"] - 0.05 for r in ok)
        tr = (f"{statistics.mean(r['train_accuracy_first'] for r in ok):.3f} -> "
              f"{_spread([r['train_accuracy_last'] for r in ok])}") if ok else ""
        ev = [r["critic_explained_var_last"] for r in ok if r.get("critic_explained_var_last") is not None]
        failed = f" ({len(runs) - len(ok)} failed)" if len(ok) < len(runs) else ""
        lines.append(f"| {arm}: {DESCRIPTION[arm]} | {len(ok)}{failed} | {start.split(' ')[0] if ok else ''} -> {end} "
                     f"| {fell} of {len(ok)} | {tr} | {_spread(ev)} |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, runs in enumerate(results.values()):
        ok = [r for r in runs if "failed" not in r]
        ax.scatter([i] * len(ok), [r["eval_last"] - r["eval_first"] for r in ok], alpha=0.7)
        if ok:
            ax.hlines(statistics.mean(r["eval_last"] - r["eval_first"] for r in ok), i - 0.3, i + 0.3)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("held-out avg@4, end - start")
    ax.set_title("ORZ rehearsal: one point per seed, bar = mean")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.orz_critic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side (default 2)")
    parser.add_argument("--only", default="", help=f"comma-separated arms of {','.join(ARMS)}")
    parser.add_argument("--table", action="store_true", help="print the table of the last results and exit")
    args = parser.parse_args(argv)
    out_path = RESULTS_DIR / "orz_critic.json"
    if args.table:
        print(table(json.loads(out_path.read_text())["results"]))
        return 0
    arms = [a for a in args.only.split(",") if a] or list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; available: {list(ARMS)}")
    results = run_arms(arms, args.seeds, args.steps, ROOT / "runs" / "orz_critic", args.parallel)
    png = plot(results, RESULTS_DIR / "orz_critic.png")
    print()
    print(table(results))
    print(f"\nmachine: {machine()}\nplot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
