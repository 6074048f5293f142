"""`pipelinerl run`: the config loaded and checked, this node's plan made, then this node's part of the run (node 0
or an engine node) under signal handlers that stop it like Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from pipelinerl.config import ConfigError, load_config, resolve_for_machine
from pipelinerl.launch.dry_run import print_dry_run
from pipelinerl.launch.engine_node import run_engine_node
from pipelinerl.launch.main_node import run_main_node
from pipelinerl.launch.preflight import preflight
from pipelinerl.launch.progress import resumed_version
from pipelinerl.placement import NodeEnv, detect_gpus, plan_node


class Interrupted(KeyboardInterrupt):
    """The launcher was asked to stop (Ctrl-C, SIGTERM, SIGUSR1): the run stops, the trainer saving first."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def main(recipe: str, overrides: list[str], dry_run: bool = False) -> int:
    """`pipelinerl run`: exit 0 when the run finished, 1 when it failed, 2 when it could not start here (a config
    error, or what `preflight` found), 128 + N when stopped by signal N. With `dry_run`: what this node would start,
    and whether it could, starting nothing (exit 0 or 2)."""
    try:
        cfg = load_config(recipe, overrides)
        node = NodeEnv.from_environ()
        gpus = detect_gpus()
        problems, warnings = preflight(cfg, recipe, node, gpus)
        for warning in warnings:
            print(f"pipelinerl: warning: {warning}", file=sys.stderr)
        if problems and not dry_run:  # (a dry run lists them after what would start)
            print(f"pipelinerl: {recipe} cannot start here:\n" + "\n".join(f"- {p}" for p in problems),
                  file=sys.stderr)
            return 2
        # "auto" settings (model.dtype, weight_sync.backend) decided for this node's GPUs, before the resolved
        # config is written for the children and the engines are given their dtype
        cfg, notes = resolve_for_machine(cfg, gpus)
        for note in notes:
            print(f"pipelinerl: {note}")
        plan = plan_node(cfg, node, gpus)
    except ConfigError as e:
        if dry_run and problems:
            print(f"pipelinerl: {recipe} cannot start here:\n" + "\n".join(f"- {p}" for p in problems),
                  file=sys.stderr)
        print(f"pipelinerl: config error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        return print_dry_run(cfg, recipe, plan, gpus, problems)
    # The node's place in the run is read; the children must not take it for their own (a trainer process that
    # saw WORLD_SIZE=2 would wait for a second trainer rank that never comes).
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    # `kill` of the launcher (and SLURM's pre-emption warning, SIGUSR1) stops the run like Ctrl-C: the trainer
    # saves a checkpoint, every child is stopped on the way out, and the exit code says the run did not finish.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, _interrupt)
    try:
        if node.rank > 0:
            return run_engine_node(cfg, plan)
        return run_main_node(cfg, plan)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        version = resumed_version(Path(cfg.run_dir))
        print(f"interrupted by {signal.Signals(signum).name}; all processes of the run stopped. The newest "
              f"checkpoint is at step {version}: rerun the same command to resume from it.", file=sys.stderr)
        return 128 + signum
