"""What stops a recipe on this node before anything starts, each problem naming what to do: missing data files,
GPUs or nodes, the engine package, a task that does not build, a run directory too small for its checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipelinerl.config import ConfigError, RunConfig
from pipelinerl.placement import NodeEnv, why_no_gpus


def preflight(cfg: RunConfig, recipe: str, node: NodeEnv, gpus: int) -> tuple[list[str], list[str]]:
    """(problems, warnings): what stops this recipe on this node before anything starts, each naming what to do,
    and what is worth saying. A 7B run should not load its model and start 8 engines only to fail on a path, a
    missing package or a full disk."""
    data = missing_data(cfg)
    problems = data + missing_resources(cfg, recipe, node, gpus) + missing_engine(cfg, gpus)
    warnings: list[str] = []
    if data:  # the task would only fail on the same files
        return problems, warnings
    # the task is built here once, so a wrong path or argument stops the run now with the key to change, not
    # later in the actor's log; its problems are drawn too, except the math task's (a hub dataset is fetched by
    # the actor; its files are checked in missing_data)
    from pipelinerl.tasks import check_task, task_from_config

    task = task_from_config(cfg.task) if cfg.task.name == "math" else check_task(cfg.task)
    from pipelinerl.tasks import is_multi_turn

    if cfg.model.chat_template and is_multi_turn(task):
        raise ConfigError(f"model.chat_template: the multi-turn task {cfg.task.name!r} builds its own context turn by "
                          "turn, so the chat template would not be applied; set it to false")
    if cfg.model.chat_template and cfg.model.init == "tiny":
        raise ConfigError("model.chat_template: a tiny model's tokenizer has no chat template; set it to false")
    # the code checker's own time for one answer against the reward pool's bound: the task's, or each mix domain's
    for name, domain in (getattr(task, "tasks", None) or {None: task}).items():
        budget, own = getattr(domain, "total_time_s", None), getattr(task, "timeouts", {}).get(name)
        bound = own or cfg.reward.timeout_s
        if budget is None or bound > budget:
            continue
        at = f"task.args.domains.{name}." if name else "task."
        key = f"{at}reward_timeout_s" if own else "reward.timeout_s"
        raise ConfigError(f"{key}: {bound:g} s would cut off the checks of {f'a {name}' if name else 'an'} answer, "
                          f"which may take {at}args.total_time_s {budget:g} s; set "
                          f"{f'{at}reward_timeout_s' if name else 'it'} above that")
    from pipelinerl.tasks.curriculum import curriculum_for

    curriculum_for(task, [], cfg.actor, cfg.seed)  # refused by name where it would do nothing (one domain)
    if node.rank == 0:
        problem, warning = run_dir_disk(cfg)
        problems += [problem] if problem else []
        warnings += [warning] if warning else []
    return problems, warnings


def missing_engine(cfg: RunConfig, gpus: int) -> list[str]:
    """The engine package the recipe's engine.kind needs, when it is missing or of the wrong build for this node."""
    from pipelinerl.gpu_setup import engine_problem

    problem = engine_problem(cfg.engine.kind, gpus > 0)
    return [f"engine.kind {cfg.engine.kind}: {problem}"] if problem else []


def run_dir_disk(cfg: RunConfig) -> tuple[str | None, str | None]:
    """(problem, warning) about the run directory's filesystem and the checkpoints it must hold (`sizing`). Not
    worked out for a tiny model (megabytes) nor for a model whose shape is not known before it is fetched (checked
    again once it is)."""
    if cfg.model.init == "tiny":  # (checkpoints are also written at the end and when stopped: always checked)
        return None, None
    from pipelinerl import plan as planning
    from pipelinerl.sizing import checkpoint_size, disk_problem

    try:
        shape = planning.model_shape(cfg)
        sharding = planning.detect_sharding(cfg)
    except ConfigError:
        return None, None
    bf16 = planning._precision(cfg, cfg.resources.gpus_per_node > 0) == "bf16"
    size = checkpoint_size(cfg, shape.num_params, sharding.deepspeed, bf16)
    where = Path(cfg.run_dir).absolute()
    while not where.exists():
        where = where.parent
    return disk_problem(cfg, size, shutil.disk_usage(where).free, str(where))


def missing_data(cfg: RunConfig) -> list[str]:
    """Local data files the recipe names that are not there, each with the command that fetches it. Checked
    before anything starts: a 7B run should not load its model and start 4 engines only to fail on a path."""
    from pipelinerl.data import missing_data_hint

    args = dict(cfg.task.args)
    where = {"task.args": args}
    if cfg.task.name == "mix":  # each domain's own files, under its own key
        where = {f"task.args.domains.{name}.args": dict(spec.get("args") or {})
                 for name, spec in (args.get("domains") or {}).items() if isinstance(spec, dict)}
    problems = []
    for prefix, domain_args in where.items():
        for name in DATA_KEYS:
            sources = domain_args.get(name) or []
            for source in [sources] if isinstance(sources, str) else list(sources):
                if not isinstance(source, str) or Path(source).exists() or not _looks_local(source):
                    continue
                hint = missing_data_hint(source)
                problems.append(f"{prefix}.{name}: {source} does not exist; "
                                + (hint or "point it at a local JSON/JSONL file (the recipe's comments say where "
                                            "its data comes from)"))
    return problems


DATA_KEYS = ("train_data", "eval_data")  # the tasks' arguments that name data files


def _looks_local(source: str) -> bool:
    """A path rather than a Hugging Face dataset name ("org/name" or "org/name:split")."""
    return source.endswith((".json", ".jsonl")) or source.startswith((".", "/")) or source.count("/") > 1


def missing_resources(cfg: RunConfig, recipe: str, node: NodeEnv, gpus: int) -> list[str]:
    """What the recipe needs (`resources`) and this machine lacks, said plainly, with where to go from here."""
    r = cfg.resources
    if r.gpus_per_node == 0:
        return []
    need = (f"{r.nodes} node(s) with {r.gpus_per_node} GPUs each"
            + (f" of at least {r.gpu_memory_gib:g} GiB" if r.gpu_memory_gib else ""))
    problems = []
    if gpus < r.gpus_per_node:
        why = why_no_gpus(gpus)
        problems.append(f"resources: the recipe needs {need}; this node has {gpus} GPU(s)"
                        + (f": {why}" if why else
                           f". `pipelinerl plan {recipe}` shows where every process goes and the memory each GPU "
                           "needs (it runs anywhere); a smaller cluster can be planned with its --nodes/"
                           "--gpus-per-node flags"))
    if node.world_size < r.nodes:
        problems.append(f"resources.nodes: the recipe runs on {r.nodes} nodes, this launch has WORLD_SIZE="
                        f"{node.world_size}; start it on every node with WORLD_SIZE, RANK, MASTER_ADDR and "
                        f"MASTER_PORT set, or on SLURM: sbatch --nodes {r.nodes} --gpus-per-node {r.gpus_per_node} "
                        f"configs/slurm/pipelinerl.sbatch {recipe}")
    return problems
