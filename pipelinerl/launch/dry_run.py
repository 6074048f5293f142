"""`pipelinerl run --dry-run`: what this node would start and whether it could, with nothing fetched, built or
started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipelinerl.config import RunConfig
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.launch.children import ProcessSpec
from pipelinerl.launch.roles import role_specs, trainer_command, trainer_env
from pipelinerl.launch.supervisor import engine_specs, engine_start_timeout
from pipelinerl.placement import NodePlan


def print_dry_run(cfg: RunConfig, recipe: str, plan: NodePlan, gpus: int, problems: list[str]) -> int:
    """`pipelinerl run --dry-run`: every process this node would start (command, environment, GPUs, log), the
    model and where it comes from, the engine package, and whether the run could start; nothing is started."""
    run_dir = Path(cfg.run_dir)
    node = plan.node
    print(f"pipelinerl run {recipe} --dry-run: node {node.rank} of {node.world_size}, {gpus} GPU(s) seen by torch; "
          "nothing is started")
    print(plan.describe())
    model_path, model_note = dry_run_model(cfg)
    print(f"model: {model_note}")
    print(f"engine: {cfg.engine.kind}, {engine_import_check(cfg.engine.kind)}; each must answer within "
          f"{engine_start_timeout(cfg):g} s (engine.start_timeout_s)")
    log_dir = run_dir / "logs" if node.rank == 0 else run_dir / "logs" / f"node{node.rank}"
    specs = [spec for spec, _, _ in engine_specs(cfg, model_path, plan.engines, log_dir, engine_start_timeout(cfg))]
    engines = f"@{run_dir / 'logs' / 'engine_urls'}"
    if node.rank == 0:
        port_note = " (the port where the trainer nodes meet: picked by node 0 at launch)" if plan.trainer_nodes > 1 \
            else ""
        specs += role_specs(cfg, engines, run_dir, plan)
        if port_note:
            print(f"trainer: {plan.trainer_processes} of trainer.num_processes {cfg.trainer.num_processes} here, "
                  f"over trainer.num_nodes {plan.trainer_nodes} nodes{port_note}")
    elif plan.runs_trainer:
        cmd = trainer_command(cfg, str(run_dir / "config.yaml"), "<every engine's URL, from node 0>",
                              len(plan.trainer_gpus), node.rank, node.master_addr, 0)
        specs.append(ProcessSpec(f"trainer {plan.trainer_ranks}", cmd, trainer_env(plan), log_dir / "trainer.log",
                                 cfg.trainer.threads))
    print("processes:")
    for spec in specs:
        print("  " + spec.describe().replace("\n", "\n  "))
    if problems:
        print(f"would not start: {len(problems)} problem(s)\n" + "\n".join(f"- {p}" for p in problems))
        return 2
    print("ready: `pipelinerl run` with the same arguments starts these")
    return 0


def dry_run_model(cfg: RunConfig) -> tuple[Path, str]:
    """(the path the engines would be given, where it comes from) without fetching or building anything."""
    path = cfg.model.path
    if cfg.model.init == "tiny":
        return Path(path), f"{path}: a tiny model the launcher builds (and warms up) there, or reuses if cached"
    from pipelinerl.models.hub import cache_dir, cached_model, is_hub_name

    if not is_hub_name(path):
        return Path(path), f"{path} (a local directory{'' if Path(path).is_dir() else ', which does not exist'})"
    cached = cached_model(path)
    if cached is not None:
        return cached, f"{path} from the Hugging Face cache, {cached} (every process of the run reads it there)"
    snapshot = cache_dir() / f"models--{path.replace('/', '--')}" / "snapshots" / "REVISION"
    return snapshot, (f"{path} from the Hugging Face hub, not cached yet: node 0's launcher fetches it once into "
                      f"{cache_dir()} before any engine starts, and every process reads it there (REVISION: the "
                      "commit fetched)")


def engine_import_check(kind: str) -> str:
    """Whether the engine's package imports in this venv (in a child: vLLM's import takes seconds and sets up
    state), in words."""
    module = engine_kind(kind).package
    if module is None:
        return "built in"
    code = f"import importlib.metadata as m, {module}; print(getattr({module}, '__version__', '?'))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"`import {module}` did not finish in 300 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import {module}` fails: {last}"
    return f"{module} {done.stdout.strip()} imports"
