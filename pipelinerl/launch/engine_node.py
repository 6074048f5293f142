"""Nodes 1..WORLD_SIZE-1 of a multi-node run: engines served to node 0, and this node's share of the trainer
processes where it is one of the trainer's nodes, until node 0 says the run is over."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipelinerl.auth import API_KEY_ENV, KEY_FILE, api_key_from_env, read_key_file
from pipelinerl.config import RunConfig
from pipelinerl.launch.children import ChildFailed
from pipelinerl.launch.model import fetch_model
from pipelinerl.launch.roles import trainer_command, trainer_env
from pipelinerl.launch.supervisor import Engines
from pipelinerl.models.hub import ModelFetchError
from pipelinerl.nodes import NodeLost, NodeRendezvous
from pipelinerl.placement import NodePlan, advertised_host
from pipelinerl.procs import start_process, stop_process, tail


def node_api_key(run_dir: Path) -> str:
    """The run's key on a node other than 0: PIPELINERL_API_KEY, else the RUN_DIR/api_key node 0 wrote."""
    key = api_key_from_env()
    if key:
        return key
    try:
        return read_key_file(run_dir / KEY_FILE)
    except ValueError as e:
        raise RuntimeError(f"no API key for this node's engines ({e}): set {API_KEY_ENV} to the same value on every "
                           "node, or put RUN_DIR on a filesystem the nodes share") from None


class RunOver(Exception):
    def __init__(self, status: str):
        self.status = status


def run_engine_node(cfg: RunConfig, plan: NodePlan) -> int:
    """Nodes 1..WORLD_SIZE-1 of a multi-node run: serve engines to node 0 and, on the trainer's other nodes (ranks
    below trainer.num_nodes), run this node's share of the trainer processes, until node 0 says the run is over."""
    node = plan.node
    run_dir = Path(cfg.run_dir)
    log_dir = run_dir / "logs" / f"node{node.rank}"
    try:
        # node 0 writes the run's key before it sets any value; this node reads it when it first checks one
        rendezvous = NodeRendezvous(node, key=lambda: node_api_key(run_dir))
        rendezvous.start_heartbeat()
    except NodeLost as e:
        print(f"pipelinerl: {e}", file=sys.stderr)
        return 1

    def stop_when_over() -> None:
        status = rendezvous.finished()
        if status is not None:
            raise RunOver(status)

    trainer: subprocess.Popen | None = None
    trainer_log = log_dir / "trainer.log"
    try:
        ready = rendezvous.wait_model(stop_when_over)
        model_path = Path(ready.path)
        if not model_path.exists() and ready.name:
            # node 0 fetched a hub model into a cache this node does not share: fetch it here, once for the node
            try:
                model_path = fetch_model(ready.name)
            except ModelFetchError as e:
                rendezvous.fail(f"node {node.rank}: {e}")
                raise RuntimeError(str(e)) from None
        # node 0 made the run's key before saying the model is ready
        os.environ[API_KEY_ENV] = node_api_key(run_dir)
        host = advertised_host(cfg.engine.host, node.master_addr, node.master_port)
        print(plan.describe())
        rendezvous.engines_starting()
        engines = Engines(cfg, model_path, plan.engines, log_dir, advertise_host=host,
                          start_timeout_s=ready.start_timeout_s)

        def watch() -> None:
            """Report a dead engine or trainer process of this node to node 0 (which stops the run naming it),
            then stop here too; stop when node 0 says the run is over."""
            try:
                engines.check()
                code = trainer.poll() if trainer is not None else None
                if code not in (None, 0):  # 0: this share trained to the end; node 0 says when the run is over
                    raise ChildFailed(f"trainer exited with code {code}\n--- last lines of {trainer_log} ---\n"
                                      f"{tail(trainer_log)}")
            except RuntimeError as e:
                rendezvous.fail(str(e))
                raise
            stop_when_over()

        try:
            try:
                engines.wait_healthy()
            except RuntimeError as e:
                rendezvous.fail(str(e))
                raise
            rendezvous.publish_engines(engines.urls)
            print(f"node {node.rank}: engines {', '.join(engines.urls)} serve node 0; logs in {log_dir}")
            if plan.runs_trainer:
                port, urls = rendezvous.wait_trainer(watch)
                cmd = trainer_command(cfg, str(run_dir / "config.yaml"), ",".join(urls), len(plan.trainer_gpus),
                                      node.rank, node.master_addr, port)
                trainer = start_process(cmd, trainer_log, threads=cfg.trainer.threads, env=trainer_env(plan))
                print(f"node {node.rank}: trainer {plan.trainer_ranks} started, meeting node 0's at "
                      f"{node.master_addr}:{port}; log in {trainer_log}")
            (log_dir / "pids.json").write_text(json.dumps(engines.pids | ({"trainer": trainer.pid} if trainer else {})))
            while True:
                watch()
                time.sleep(0.5)
        except RunOver as over:
            if trainer is not None and over.status == "ok":
                # node 0's trainer processes are done, so this node's are past their last collective: let them
                # finish writing and exit on their own
                with contextlib.suppress(subprocess.TimeoutExpired):
                    trainer.wait(timeout=60)
            raise
        finally:
            if trainer is not None:
                stop_process(trainer)
            engines.stop()
    except RunOver as over:
        print(f"node {node.rank}: the run is over ({over.status}); its processes stopped")
        return 0 if over.status == "ok" else 1
    except (NodeLost, RuntimeError, TimeoutError) as e:
        print(f"pipelinerl: node {node.rank} failed: {e}", file=sys.stderr)
        return 1
