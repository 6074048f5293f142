"""`pipelinerl plan RECIPE [overrides] [--nodes N --gpus-per-node G --gpu-memory GIB --host-memory GIB --json]
[--time --gpu h100|h200|a100|cpu --mean-answer-tokens T --mean-prompt-tokens T --mfu F --mbu F --usd-per-gpu-hour X]`:
its arguments, the cluster they describe, and `main`, which plans the recipe and prints the plan (and, with
`--time`, the forecast of a step and of the run: `forecast`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pipelinerl.config import ConfigError, RunConfig, load_config, resolve_for_machine
from pipelinerl.placement import listed_gpus
from pipelinerl.plan.fit import Cluster, Plan, make_plan
from pipelinerl.plan.forecast import GPU_KINDS, Forecast, accelerator, assumptions, default_gpu, forecast
from pipelinerl.plan.forecast import forecast_to_json as forecast_json
from pipelinerl.plan.report import format_forecast, format_plan, plan_to_json
from pipelinerl.plan.units import GIB


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's resources.nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: resources.gpus_per_node; 0 plans a CPU run)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory per GPU in GiB (default: resources.gpu_memory_gib)")
    parser.add_argument("--host-memory", type=float, default=None, metavar="GIB",
                        help="host memory per node in GiB (default: this machine's; 0: not checked)")
    parser.add_argument("--json", action="store_true", default=None, help="print the plan as JSON")
    # the forecast: any of its flags asks for it
    parser.add_argument("--time", action="store_true", default=None,
                        help="also forecast one RL step and the whole run: seconds, samples/s, GPU-hours, cost")
    parser.add_argument("--gpu", default=None, metavar="KIND",
                        help=f"the accelerator forecast for: {', '.join(GPU_KINDS)} (cpu: this machine, measured in "
                             "about a second; default: h100, h200 for GPUs of more than 80 GiB, cpu for a CPU recipe)")
    parser.add_argument("--mean-answer-tokens", type=int, default=None, metavar="T",
                        help="expected mean answer length (default: half of sampling.max_new_tokens)")
    parser.add_argument("--mean-prompt-tokens", type=int, default=None, metavar="T",
                        help="expected mean prompt length (default: 256, at most half the prompt room)")
    parser.add_argument("--mfu", type=float, default=None, metavar="F",
                        help="model-FLOPs utilisation of training and prefill (default: 0.4 on GPUs)")
    parser.add_argument("--mbu", type=float, default=None, metavar="F",
                        help="fraction of memory bandwidth a decode step reaches (default: 0.7 on GPUs)")
    parser.add_argument("--usd-per-gpu-hour", type=float, default=None, metavar="X",
                        help="price of a GPU-hour (a core-hour on CPU), for the run's cost")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/orz_7b.yaml")
    # the rest, flags included: argparse alone rejects overrides that follow a flag (`RECIPE --nodes 2 a=b`)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. trainer.lr=1e-6")
    _add_flags(parser)


def _flags_among_overrides(args: argparse.Namespace) -> None:
    """Move flags that came after the recipe out of `args.overrides` into `args`."""
    parser = argparse.ArgumentParser(prog="pipelinerl plan", add_help=False, allow_abbrev=False)
    _add_flags(parser)
    flags, rest = parser.parse_known_args(args.overrides)
    for name, value in vars(flags).items():
        if value is not None:
            setattr(args, name, value)
    unknown = [x for x in rest if x.startswith("-")]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown option (the options are --nodes, --gpus-per-node, --gpu-memory, "
                          f"--host-memory, --json, {', '.join(TIME_FLAGS)})")
    args.overrides = rest


TIME_FLAGS = ("--time", "--gpu", "--mean-answer-tokens", "--mean-prompt-tokens", "--mfu", "--mbu",
              "--usd-per-gpu-hour")


def _wants_forecast(args: argparse.Namespace) -> bool:
    return any(getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None for flag in TIME_FLAGS)


def forecast_of(args: argparse.Namespace, cfg: RunConfig, plan: Plan) -> Forecast:
    """The forecast the flags ask for. Raises ConfigError naming a bad flag."""
    kind = args.gpu or default_gpu(cfg)
    if kind not in GPU_KINDS:
        raise ConfigError(f"--gpu: must be one of {', '.join(GPU_KINDS)}, got {kind!r}")
    if plan.on_gpu and kind == "cpu":
        raise ConfigError("--gpu: cpu forecasts a CPU recipe, and this one places GPUs (--gpus-per-node 0 plans it "
                          "on CPU)")
    if not plan.on_gpu and kind != "cpu":
        raise ConfigError(f"--gpu: {kind} forecasts GPUs, and this is a CPU recipe (resources.gpus_per_node 0); "
                          "leave --gpu out (cpu: this machine) or plan GPUs with --gpus-per-node and --gpu-memory")
    acc = accelerator(kind)
    given = assumptions(cfg, acc, args.mean_answer_tokens, args.mean_prompt_tokens, args.mfu, args.mbu,
                        args.usd_per_gpu_hour)
    return forecast(cfg, plan, acc, given)


def check_flags(nodes: int | None, gpus: int | None, memory: float | None) -> None:
    """Raises ConfigError naming the flag."""
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes: must be at least 1, got {nodes}")
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--gpus-per-node: must be >= 0 (0: a CPU run), got {gpus}")
    if memory is not None and not memory > 0:
        raise ConfigError(f"--gpu-memory: must be > 0 GiB, got {memory:g}")


def machine_host_memory_gib() -> float:
    """This machine's memory in GiB (/proc/meminfo's MemTotal; 0 where that cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def cluster_of(cfg: RunConfig) -> Cluster:
    """The cluster a recipe is planned for: its `resources` (which the flags override)."""
    r = cfg.resources
    if r.gpus_per_node and r.gpu_memory_gib <= 0:
        raise ConfigError("resources.gpu_memory_gib: the recipe does not state its GPUs' memory; pass --gpu-memory")
    return Cluster(r.nodes, r.gpus_per_node, r.gpu_memory_gib)


def main(args: argparse.Namespace) -> int:
    """0: the recipe fits; 1: it does not; 2: a configuration error."""
    try:
        _flags_among_overrides(args)
        check_flags(args.nodes, args.gpus_per_node, args.gpu_memory)
        # the flags go in as overrides of `resources`, so the config's own checks see the cluster planned for
        flags = {"resources.nodes": args.nodes, "resources.gpus_per_node": args.gpus_per_node,
                 "resources.gpu_memory_gib": args.gpu_memory}
        overrides = list(args.overrides) + [f"{k}={v}" for k, v in flags.items() if v is not None]
        cfg = load_config(args.recipe, overrides)
        if args.host_memory is not None and args.host_memory < 0:
            raise ConfigError(f"--host-memory: must be >= 0 GiB (0: not checked), got {args.host_memory:g}")
        host = machine_host_memory_gib() if args.host_memory is None else args.host_memory
        guessed = args.host_memory is None and cfg.resources.gpus_per_node > 0 and listed_gpus() == 0
        cluster = dataclasses.replace(cluster_of(cfg), host_memory_gib=host, host_memory_guessed=guessed)
        cfg, _ = resolve_for_machine(cfg, cluster.gpus_per_node)  # the report names the dtype it planned
        plan = make_plan(cfg, cluster)
        predicted = forecast_of(args, cfg, plan) if _wants_forecast(args) else None
    except ConfigError as e:
        print(f"pipelinerl plan: config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        data = plan_to_json(plan, cfg)
        if predicted is not None:
            data["forecast"] = forecast_json(predicted)
        print(json.dumps(data, indent=2))
    else:
        print(format_plan(plan, cfg, args.recipe))
        if predicted is not None:
            print()
            print(format_forecast(predicted))
    return 0 if plan.fits else 1
