"""The trainer and the actor on node 0: their commands and environments, started, checked, followed to the end of
the run, and stopped (the trainer given time to save its checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipelinerl.config import RunConfig
from pipelinerl.engines.client import EngineClient
from pipelinerl.launch.children import ChildFailed, ProcessSpec
from pipelinerl.launch.progress import Progress, read_new_rows, resumed_version
from pipelinerl.metrics import continue_metrics
from pipelinerl.placement import NodePlan, gpu_env
from pipelinerl.procs import POOL_SOLVED_EXIT, free_port, stop_process, stop_processes, tail, tool_command
from pipelinerl.streams import reset_stream


def trainer_command(cfg: RunConfig, config: str, urls: str, gpus: int, node_rank: int = 0,
                    main_addr: str = "127.0.0.1", main_port: int = 0) -> list[str]:
    """One process, or `trainer.num_processes` under accelerate (GPUs, or an accelerate config such as
    DeepSpeed ZeRO-3) or torchrun (data parallel on CPU, where `accelerate launch` would need mpirun).

    With `trainer.num_nodes` > 1 this is trainer node `node_rank`'s share (num_processes / num_nodes processes,
    global ranks from node_rank * share): the launchers of all trainer nodes start theirs with the same arguments
    but the rank, and they meet at `main_addr`:`main_port` (node 0's address, a port node 0 chose)."""
    t = cfg.trainer
    role = ["-m", "pipelinerl.train", config, "--engines", urls]
    if t.num_processes == 1 and not t.accelerate_config:
        return [sys.executable, *role]
    nodes = t.num_nodes
    if not gpus and not t.accelerate_config:
        if nodes == 1:  # --standalone: torchrun's own rendezvous on a port it picks itself
            return tool_command("torch.distributed.run", "--standalone", "--nproc-per-node", str(t.num_processes),
                                *role)
        return tool_command("torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node_rank),
                            "--master-addr", main_addr, "--master-port", str(main_port),
                            "--nproc-per-node", str(t.num_processes // nodes), *role)
    launch = tool_command("accelerate.commands.launch", "--num_processes", str(t.num_processes))
    if nodes == 1:
        launch += ["--num_machines", "1", "--main_process_port", str(free_port())]
    else:
        launch += ["--num_machines", str(nodes), "--machine_rank", str(node_rank), "--main_process_ip", main_addr,
                   "--main_process_port", str(main_port)]
        if t.accelerate_config:
            # accelerate's default for DeepSpeed on several machines is pdsh, one command reaching every node over
            # ssh; here every node's launcher starts its own share, which "standard" (torchrun per node) does
            launch += ["--deepspeed_multinode_launcher", "standard"]
    if t.accelerate_config:
        launch += ["--config_file", t.accelerate_config]
    elif t.num_processes > 1:
        launch += ["--multi_gpu"]
    return [*launch, *role]


def trainer_env(plan: NodePlan) -> dict[str, str]:
    """The environment of this node's trainer processes beside the launcher's own: the node's trainer GPUs."""
    return gpu_env(plan.trainer_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def role_specs(cfg: RunConfig, engines: str, run_dir: Path, plan: NodePlan, trainer_port: int = 0
               ) -> list[ProcessSpec]:
    """The trainer and the actor. `engines`: their `--engines` argument, the engine URLs or `@FILE` (they load
    their models and wait for the file, which `run_main_node` writes once every engine answers). `trainer_port`:
    where the trainer processes of all trainer nodes meet (trainer.num_nodes > 1)."""
    config = str(run_dir / "config.yaml")
    gpus = plan.trainer_gpus
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""} if gpus else {}  # the actor and reward workers never need one
    trainer = trainer_command(cfg, config, engines, len(gpus), 0, plan.node.master_addr, trainer_port)
    logs = run_dir / "logs"
    return [ProcessSpec("trainer", trainer, trainer_env(plan), logs / "trainer.log", cfg.trainer.threads),
            ProcessSpec("actor", [sys.executable, "-m", "pipelinerl.actor", config, "--engines", engines], no_gpu,
                        logs / "actor.log", 1)]


def start_roles(cfg: RunConfig, engines: str, run_dir: Path, plan: NodePlan, trainer_port: int = 0
                ) -> dict[str, subprocess.Popen]:
    """Start the trainer and the actor (`role_specs`)."""
    reset_stream(cfg.streams, run_dir, "control")  # control messages are per launch
    # a resumed run redoes the steps after its checkpoint: their old rows go now, before progress reads the file
    continue_metrics(run_dir, resumed_version(run_dir))
    return {spec.name: spec.start() for spec in role_specs(cfg, engines, run_dir, plan, trainer_port)}


def check_roles(children: dict[str, subprocess.Popen], run_dir: Path) -> None:
    """Raise ChildFailed naming a role that exited with an error, with its log's last lines."""
    for name, proc in children.items():
        code = proc.poll()
        if name == "actor" and code == POOL_SOLVED_EXIT:
            continue  # every training problem solved: follow_pipeline ends the run as a success
        if code is not None and code != 0:  # the actor exits 0 on the trainer's "done"
            log = run_dir / "logs" / f"{name}.log"
            raise ChildFailed(f"{name} exited with code {code}\n--- last lines of {log} ---\n{tail(log)}")


def follow_pipeline(cfg: RunConfig, children: dict[str, subprocess.Popen], urls: list[str], run_dir: Path,
                    check: Callable[[], None]) -> None:
    """Show progress until the trainer finishes; then record what the engines saw. `check` raises when an engine
    (on any node) is gone."""
    metrics_path = run_dir / "metrics.jsonl"
    _, offset = read_new_rows(metrics_path, 0)  # a resumed run: show only new steps
    progress = Progress(cfg.trainer.max_steps, cfg.metrics.log_every_s, resumed_at=resumed_version(run_dir))
    try:
        while True:
            check()
            check_roles(children, run_dir)
            rows, offset = read_new_rows(metrics_path, offset)
            for row in rows:
                progress.show(row)
            if children["actor"].poll() == POOL_SOLVED_EXIT:
                print(f"pipelinerl: the training problems were solved (all {cfg.sampling.group_size} answers right) "
                      "and retired (actor.retire_solved), all but those that keep coming back all wrong and that "
                      "this policy has hardly ever answered right, so nothing is left to learn from: the run ends "
                      "here, its trainer saving a checkpoint (RUN_DIR/logs/actor.log says how many were left)",
                      file=sys.stderr)
                return
            if children["trainer"].poll() == 0:
                children["actor"].wait(timeout=60)  # it stops on the trainer's "done" message
                for i, url in enumerate(urls):  # what the engines saw, for the record
                    client = EngineClient(url)
                    try:
                        (run_dir / f"engine{i}_metrics.json").write_text(json.dumps(client.metrics(), indent=1))
                    finally:
                        client.close()
                return
            time.sleep(0.5)
    finally:
        progress.close()


def write_pids(run_dir: Path, roles: dict[str, subprocess.Popen], engine_pids: dict[str, int]) -> None:
    """RUN_DIR/pids.json: the process ids of the run's roles and engines on this node, for whoever must signal one."""
    (run_dir / "pids.json").write_text(json.dumps({name: p.pid for name, p in roles.items()} | engine_pids))


def stop_roles(cfg: RunConfig, children: dict[str, subprocess.Popen]) -> None:
    """The trainer and the actor at once: the trainer given `trainer.stop_grace_s` to save its checkpoint (it saves
    on SIGTERM), the actor, which saves nothing, 10 s; then whatever lingers is killed."""
    others = [p for name, p in children.items() if name != "trainer"]
    for proc in others:  # the actor stops while the trainer saves
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    if "trainer" in children:
        stop_process(children["trainer"], timeout_s=cfg.trainer.stop_grace_s)
    stop_processes(others)
