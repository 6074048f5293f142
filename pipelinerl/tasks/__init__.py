"""Pluggable tasks: a dataset of prompts plus a verifier (see `base.Task`), and optionally a multi-turn
`rollout` (see `pipelinerl.tasks.workflow`).

A recipe names its task in `task.name`: a built-in ("arithmetic": generated "a+b=" problems for tiny models;
"math": competition math from local files or the hub, verified with math-verify; "code": programming problems
checked by running them in a sandbox) or any "package.module:Class" the processes can import, built with the
`task.args` mapping as keyword arguments (and `task.seed` as `seed`, when it takes one). A new task is therefore
one file and one line of YAML:

    task:
      name: my_tasks.sorting:SortingTask
      args: {num_train: 5000, max_len: 8}

Task modules are imported on first use, so asking for arithmetic never imports sympy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipelinerl.plugins import TASKS, UnknownPlugin
from pipelinerl.tasks.base import MultiTurnTask, Task, is_multi_turn, reward_item

if TYPE_CHECKING:
    from pipelinerl.config import TaskConfig

__all__ = ["TASKS", "MultiTurnTask", "Task", "check_task", "get_task", "is_multi_turn", "register_task", "reward_item",
           "task_from_config"]

def register_task(name: str, factory: Callable[..., Task] | str) -> None:
    """Make `task.name: name` (and `get_task(name, ...)`) build tasks with `factory(**kwargs)`; `factory` may be
    the "module:attr" where it lives. A task registered under a name that exists replaces it."""
    TASKS.add(name, factory, replace=True)


def get_task(name: str, **kwargs: Any) -> Task:
    """The task `name` (registered in pipelinerl.plugins.TASKS, or "package.module:Class") built with `kwargs`."""
    return TASKS.get(name)(**kwargs)


def task_from_config(cfg: TaskConfig) -> Task:
    """The task a run's `task:` config section describes. Errors name the key to change: an unimportable
    `task.name`, an argument the task does not take, or a value it refuses (`task.args`)."""
    from pipelinerl.config import ConfigError

    try:
        factory = TASKS.get(cfg.name)
    except UnknownPlugin as e:
        raise ConfigError(f"task.name: cannot load {cfg.name!r}: {e}") from None
    args = dict(cfg.args)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says what is wrong
        signature = None
    parameters = signature.parameters.values() if signature else ()
    if any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in parameters):
        if "seed" in args and cfg.seed not in (0, args["seed"]):
            raise ConfigError(f"task.args.seed ({args['seed']}) and task.seed ({cfg.seed}) disagree; set task.seed "
                              "alone")
        args.setdefault("seed", cfg.seed)
    elif cfg.seed != 0:
        raise ConfigError(f"task.seed: {cfg.name} takes no seed (its problems do not depend on one), so "
                          f"task.seed={cfg.seed} would have no effect; remove it")
    if signature is not None:
        try:
            signature.bind(**args)
        except TypeError as e:
            raise ConfigError(f"task.args: {cfg.name} does not take these arguments: {e}") from None
    try:
        task = factory(**args)
    except (TypeError, ValueError, OSError) as e:  # OSError: a data file it could not read
        raise ConfigError(f"task.args: {cfg.name} refused its arguments: {e}") from None
    missing = [a for a in ("name", "reward_fn", "train_problems", "eval_problems", "prompt") if not hasattr(task, a)]
    if missing:
        raise ConfigError(f"task.name: {cfg.name} built an object without {', '.join(missing)}; a task needs all "
                          "of them (see pipelinerl.tasks.base.Task)")
    return task


def check_task(cfg: TaskConfig) -> Task:
    """Build the task and draw its problems once, so that a wrong path, argument or data file stops a run before
    anything starts, with the key to change (problems are often made lazily, where an error would surface as a
    traceback in the actor's log)."""
    from pipelinerl.config import ConfigError

    task = task_from_config(cfg)
    try:
        if not task.train_problems():
            raise ValueError("it has no training problems")
        task.eval_problems()
    except (ValueError, OSError, ImportError) as e:  # ImportError: an optional package a source needs
        raise ConfigError(f"task.args: {cfg.name} cannot make its problems: {e}") from None
    return task
