"""The launcher role: `pipelinerl run RECIPE.yaml [overrides]`.

It resolves the config into the run directory, prepares the model, starts the engines, waits for them to be
healthy, then starts the trainer and the actor, each as its own process, and watches all of them: if one dies
the run stops with the cause and the child's last log lines; Ctrl-C stops every child. A rerun in the same
run directory resumes from the last checkpoint.

Multi-node (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT in the environment; `pipelinerl.placement` says what runs
where): every node runs this launcher with the same recipe; node 0 does all of the above, the other nodes start
engines and hand their URLs to node 0 through `pipelinerl.nodes`, and with `trainer.num_nodes` > 1 the first ones
also start their share of the trainer processes once node 0 says where those meet.

The units, in the order a run meets them:
    run          `main`: config, preflight, plan, signals, then this node's part
    preflight    what stops a recipe here before anything starts
    dry_run      `--dry-run`: what would start, nothing started
    model        the model made ready (a tiny one built and warmed up, a hub one fetched)
    children     a child process described before it starts; the error naming one that died
    supervisor   the engines of a node: started, waited for, restarted, stopped
    roles        the trainer and the actor: commands, start, check, follow, stop
    progress     the progress display, the checkpoint a rerun resumes from, the final report
    main_node    node 0's run
    engine_node  the other nodes' run

The names below are re-exported because the command line, the tests and the bench scripts import them from here.
"""

from pipelinerl.launch.children import ChildFailed, ProcessSpec
from pipelinerl.launch.dry_run import dry_run_model, engine_import_check, print_dry_run
from pipelinerl.launch.engine_node import RunOver, node_api_key, run_engine_node
from pipelinerl.launch.main_node import run_main_node
from pipelinerl.launch.model import fetch_hub_model, fetch_model, prepare_model, replace_dir
from pipelinerl.launch.preflight import missing_data, missing_engine, missing_resources, preflight, run_dir_disk
from pipelinerl.launch.progress import Progress, read_new_rows, report, resumed_version
from pipelinerl.launch.roles import (
    check_roles,
    follow_pipeline,
    role_specs,
    start_roles,
    stop_roles,
    trainer_command,
    trainer_env,
    write_pids,
)
from pipelinerl.launch.run import Interrupted, main
from pipelinerl.launch.supervisor import Engines, engine_specs, engine_start_timeout, gpu_memory_args

__all__ = [
    "ChildFailed", "Engines", "Interrupted", "ProcessSpec", "Progress", "RunOver", "check_roles", "dry_run_model",
    "engine_import_check", "engine_specs", "engine_start_timeout", "fetch_hub_model", "fetch_model",
    "follow_pipeline", "gpu_memory_args", "main", "missing_data", "missing_engine", "missing_resources",
    "node_api_key", "preflight", "prepare_model", "print_dry_run", "read_new_rows", "replace_dir", "report",
    "resumed_version", "role_specs", "run_dir_disk", "run_engine_node", "run_main_node", "start_roles",
    "stop_roles", "trainer_command", "trainer_env", "write_pids",
]
