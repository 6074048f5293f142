"""What mixing domains costs or gains: `make compare-domains` (or `python -m bench.compare_domains [--steps N]
[--seeds 0,1] [--only mix,add,...]`).

`recipes/tiny_mix_cpu.yaml` trains on its three domains at once ("mix"); each domain is then trained alone
("<domain>": the same recipe holding that one domain) for the same number of steps and samples per step, from the
mix run's own warmed-up base model, so that only the mixing differs. Each domain's held-out accuracy (its own
benchmark, `eval_<domain>_avg@k`) is compared at the start and the end, with the RL seconds of each run. Writes
bench/results/compare_domains.json and .png and prints a Markdown table for docs/domains.md.

A run that finished (exit 0) is recorded in its folder under runs/compare_domains and read back by a later call, so
a second call runs only what failed or is new (remove runs/compare_domains to start over, as after a change of
--steps or of the recipe).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import RESULTS_DIR, machine, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_mix_cpu.yaml"


def domains() -> list[str]:
    return list(yaml.safe_load(RECIPE.read_text())["task"]["args"]["domains"])


def single_domain_recipe(domain: str, base_model: Path, out: Path) -> Path:
    """The mix recipe holding `domain` alone, started from `base_model` (the mix run's warmed-up model)."""
    recipe = yaml.safe_load(RECIPE.read_text())
    spec = recipe["task"]["args"]["domains"][domain]
    recipe["task"]["args"] = {"domains": {domain: spec}}
    recipe["model"] = {"path": str(base_model)}
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return out


def launch(recipe: Path, run_dir: Path, overrides: list[str], timeout_s: int = 7200) -> tuple[list[dict], str | None]:
    """The run's metrics rows, and why it failed (None: exit 0). A failed run keeps the rows it wrote, and the
    comparison goes on: its numbers are reported with the failure beside them."""
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", str(recipe), f"run_dir={run_dir}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=subprocess_env())
    failure = None
    if r.returncode != 0:
        failure = f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"
        print(f"run in {run_dir} failed ({failure}); its log: {run_dir / 'logs'}\n{r.stderr[-3000:]}",
              file=sys.stderr, flush=True)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return rows, failure


def held_out(rows: list[dict], domain: str) -> list[tuple[int, float]]:
    """(step, avg@k) of one domain's benchmark."""
    keys = [k for r in rows for k in r if k.startswith(f"eval_{domain}_avg@")]
    return [(r["step"], r[keys[0]]) for r in rows if keys and keys[0] in r]


def compare(names: list[str], seeds: list[int], steps: int | None) -> dict:
    runs_root = ROOT / "runs" / "compare_domains"
    extra = ["trainer.save_every=0"] + ([f"trainer.max_steps={steps}"] if steps else [])
    results: dict[str, dict] = {}
    for seed in seeds:
        mix_dir = runs_root / f"mix_s{seed}"
        base = mix_dir / "base_model"
        for name in names:
            if name == "mix":
                recipe, run_dir, overrides = RECIPE, mix_dir, [f"seed={seed}", *extra]
            else:
                if not (base / "config.json").exists():
                    raise RuntimeError(f"{name}: needs the mix run's base model in {base}; run 'mix' first")
                run_dir = runs_root / f"{name}_s{seed}"
                run_dir.mkdir(parents=True, exist_ok=True)
                recipe = single_domain_recipe(name, base, run_dir.parent / f"{name}_s{seed}.yaml")
                overrides = [f"seed={seed}", *extra]
            record = run_dir / "compare_result.json"
            if record.exists():  # finished in an earlier call: read back (a failed run is run again, from scratch)
                print(f"== {name}, seed {seed}: read back from {record}", flush=True)
                results.setdefault(name, {"seeds": {}})["seeds"][seed] = json.loads(record.read_text())
                continue
            if name != "mix" and (run_dir / "metrics.jsonl").exists():
                shutil.rmtree(run_dir)  # a failed or cut-short run: it would resume from its checkpoint
                run_dir.mkdir(parents=True)  # (its recipe, written beside the folder, stays)
            print(f"== {name}, seed {seed}", flush=True)
            t0 = time.perf_counter()
            rows, failure = launch(recipe, run_dir, overrides)
            steps_rows = [r for r in rows if "reward_mean" in r]
            per_domain = {d: held_out(rows, d) for d in (domains() if name == "mix" else [name])}
            result = {"held_out": per_domain, "rl_seconds": steps_rows[-1]["time"] if steps_rows else None,
                      "wall_seconds": round(time.perf_counter() - t0, 1), "steps": len(steps_rows), "failure": failure}
            results.setdefault(name, {"seeds": {}})["seeds"][seed] = result
            if failure is None:
                record.write_text(json.dumps(result) + "\n")
    out = {"machine": machine(), "recipe": str(RECIPE.relative_to(ROOT)), "seeds": seeds, "results": results}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "compare_domains.json").write_text(json.dumps(out, indent=2) + "\n")
    out["png"] = str(plot(results, RESULTS_DIR / "compare_domains.png"))
    return out


def gains(results: dict, run: str, domain: str) -> list[float]:
    """Each seed's held-out gain of `domain` in `run`, in points."""
    out = []
    for r in results.get(run, {}).get("seeds", {}).values():
        curve = r["held_out"].get(domain) or []
        if len(curve) > 1:
            out.append(100 * (curve[-1][1] - curve[0][1]))
    return out


def table(results: dict) -> str:
    lines = ["| domain | trained | held-out gain, points (mean ± sd over seeds) | end accuracy | RL seconds |",
             "| --- | --- | --- | --- | --- |"]
    for domain in domains():
        for run in ("mix", domain):
            seeds = results.get(run, {}).get("seeds", {})
            if not seeds:
                continue
            g = gains(results, run, domain)
            ends = [r["held_out"][domain][-1][1] for r in seeds.values() if r["held_out"].get(domain)]
            secs = [r["rl_seconds"] for r in seeds.values() if r["rl_seconds"]]
            failed = sum(1 for r in seeds.values() if r.get("failure"))
            spread = f" ± {statistics.stdev(g):.1f}" if len(g) > 1 else ""
            spread += f", {failed} failed" if failed else ""
            lines.append(f"| {domain} | {'with the others' if run == 'mix' else 'alone'} | "
                         f"{statistics.mean(g):+.1f}{spread} ({len(g)} seeds) | "
                         f"{statistics.mean(ends):.3f} | {statistics.mean(secs):.0f} |" if g else
                         f"| {domain} | {run} | - | - | - |")
    return "\n".join(lines)


def plot(results: dict, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = domains()
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, domain in zip(axes.flat, names):
        for run, style in (("mix", "-"), (domain, "--")):
            for seed, r in results.get(run, {}).get("seeds", {}).items():
                curve = r["held_out"].get(domain) or []
                if curve:
                    ax.plot([s for s, _ in curve], [a for _, a in curve], style, marker="o",
                            label=f"{'mix' if run == 'mix' else 'alone'}, seed {seed}")
        ax.set_title(f"{domain}: held-out accuracy")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--only", default="", help="comma-separated runs: mix and/or domain names (mix first)")
    args = parser.parse_args(argv)
    available = ["mix", *domains()]
    names = [n for n in args.only.split(",") if n] or available
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; available: {available}")
    out = compare(names, [int(s) for s in args.seeds.split(",") if s], args.steps)
    print()
    print(table(out["results"]))
    print(f"\nmachine: {out['machine']}\nplot: {out['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
