"""Node 0 (the only node of a single-node run): the model made ready, the engines started and healthy, the trainer
and the actor started and followed to the end, the report; on several nodes, the rendezvous with the others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipelinerl.auth import API_KEY_ENV, is_loopback, run_api_key
from pipelinerl.config import ConfigError, RunConfig, save_resolved_config
from pipelinerl.launch.children import ChildFailed
from pipelinerl.launch.model import fetch_hub_model, prepare_model
from pipelinerl.launch.preflight import run_dir_disk
from pipelinerl.launch.progress import report, resumed_version
from pipelinerl.launch.roles import check_roles, follow_pipeline, start_roles, stop_roles, write_pids
from pipelinerl.launch.supervisor import Engines, engine_start_timeout
from pipelinerl.models.hub import ModelFetchError
from pipelinerl.nodes import NodeRendezvous
from pipelinerl.placement import NodePlan
from pipelinerl.procs import free_port, write_engine_urls
from pipelinerl.streams import StreamBackendError, check_backend


def run_main_node(cfg: RunConfig, plan: NodePlan) -> int:
    """Node 0 (the only node of a single-node run): model, engines, trainer, actor, progress, report."""
    run_dir = Path(cfg.run_dir)
    node = plan.node
    if node.multi_node and is_loopback(cfg.weight_sync.master_address) and not is_loopback(node.master_addr):
        cfg.weight_sync.master_address = node.master_addr  # engines on other nodes join the trainer's group there
    try:
        check_backend(cfg.streams)  # an unreachable Redis stops the run before any process starts
    except StreamBackendError as e:
        print(f"pipelinerl: {e}", file=sys.stderr)
        return 2
    # the store's values are signed with the run's key, which the launcher makes below (before any value is set)
    rendezvous = NodeRendezvous(node, key=lambda: os.environ[API_KEY_ENV]) if node.multi_node else None
    ok = False
    try:
        done = resumed_version(run_dir)
        if done >= cfg.trainer.max_steps:
            print(f"{run_dir} already holds a finished run (version {done} of trainer.max_steps "
                  f"{cfg.trainer.max_steps}); to train more raise trainer.max_steps, to start over use another "
                  "run_dir")
            report(run_dir)
            ok = True
            return 0
        model_name = cfg.model.path
        try:
            cfg = fetch_hub_model(cfg)
        except ModelFetchError as e:
            print(f"pipelinerl: {e}", file=sys.stderr)
            return 2
        problem, _ = run_dir_disk(cfg)  # again, now that the model's config is at hand
        if problem:
            print(f"pipelinerl: {cfg.run_dir} cannot hold this run's checkpoints:\n- {problem}", file=sys.stderr)
            return 2
        save_resolved_config(cfg, run_dir)
        # owner only: samples, evaluations and checkpoints hold the answers, and sandboxed programs (the code
        # reward, tools) run as other users that must not read them
        run_dir.chmod(0o700)
        # the key every engine of the run requires; the processes started from here (and this one's clients) read
        # it from the environment (pipelinerl/auth.py)
        os.environ[API_KEY_ENV] = run_api_key(run_dir)
        try:
            model_path = prepare_model(cfg)
        except ConfigError as e:
            print(f"pipelinerl: config error: {e}", file=sys.stderr)
            return 2
        start_timeout_s = engine_start_timeout(cfg)
        if rendezvous:
            rendezvous.model_ready(str(model_path), model_name, start_timeout_s)
        print(plan.describe())
        urls_file = run_dir / "logs" / "engine_urls"
        urls_file.unlink(missing_ok=True)  # a previous launch's engines had other ports
        engines = Engines(cfg, model_path, plan.engines, run_dir / "logs", start_timeout_s=start_timeout_s)
        children: dict[str, subprocess.Popen] = {}
        try:
            print(f"starting {len(plan.engines)} {cfg.engine.kind} engine(s); logs in {run_dir / 'logs'}")
            # the trainer and the actor import and load their models while the engines load theirs, then wait for
            # the engines' URLs. Not when a trainer of several nodes (its other nodes need the URLs to start), nor
            # when engines share the trainer's GPUs: vLLM sizes its KV cache from the memory it sees used on its GPU
            # while it starts, which a trainer loading beside it would change under it
            early = cfg.trainer.num_nodes == 1 and not (cfg.engine.colocate_with_trainer and plan.trainer_gpus)
            if early:
                children = start_roles(cfg, f"@{urls_file}", run_dir, plan)
                write_pids(run_dir, children, engines.pids)
            engines.wait_healthy(check=lambda: check_roles(children, run_dir))
            urls, check, trainer_port = engines.urls, engines.check, 0
            if rendezvous:
                urls = rendezvous.gather_engines(urls, engines.check, start_timeout_s)
                print(f"engines of all {node.world_size} nodes: {', '.join(urls)}")
                if cfg.trainer.num_nodes > 1:  # the other trainer nodes start their processes now
                    trainer_port = free_port()
                    rendezvous.start_trainer(trainer_port, urls)

                def check() -> None:
                    engines.check()
                    rendezvous.raise_if_failed()
                    rendezvous.check_nodes()
            write_engine_urls(urls_file, urls)
            if not early:
                children = start_roles(cfg, ",".join(urls), run_dir, plan, trainer_port)
                write_pids(run_dir, children, engines.pids)
            follow_pipeline(cfg, children, urls, run_dir, check)
        except (RuntimeError, TimeoutError) as e:
            if rendezvous and isinstance(e, ChildFailed):
                e = rendezvous.root_cause(e)
            print(f"pipelinerl: run failed: {e}", file=sys.stderr)
            return 1
        finally:
            stop_roles(cfg, children)
            engines.stop()
        report(run_dir)
        ok = True
        return 0
    finally:
        if rendezvous:
            rendezvous.finish(ok)
