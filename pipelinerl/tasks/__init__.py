"""Pluggable tasks: a dataset of prompts plus a verifier (see `base.Task`), looked up by name.

Built-in: "arithmetic" (generated "a+b=" problems for tiny models) and "math" (competition math from local
files or the hub, verified with math-verify). Task modules are imported on first use, so asking for arithmetic
never imports sympy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipelinerl.tasks.base import Task, reward_item

if TYPE_CHECKING:
    from pipelinerl.config import TaskConfig

__all__ = ["TASKS", "Task", "get_task", "register_task", "reward_item", "task_from_config"]

# name -> task factory, or "module:attribute" of one (imported lazily)
TASKS: dict[str, Callable[..., Task] | str] = {
    "arithmetic": "pipelinerl.tasks.arithmetic:ArithmeticTask",
    "math": "pipelinerl.tasks.math_data:MathTask",
}


def register_task(name: str, factory: Callable[..., Task] | str) -> None:
    """Make `get_task(name, ...)` build tasks with `factory(**kwargs)`."""
    TASKS[name] = factory


def get_task(name: str, **kwargs: Any) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    factory = TASKS[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(**kwargs)


def task_from_config(cfg: TaskConfig) -> Task:
    """The task a run's `task:` config section describes."""
    if cfg.name == "arithmetic":
        return get_task("arithmetic", digits=cfg.digits, ops=cfg.ops, num_train=cfg.num_train,
                        num_eval=cfg.num_eval, seed=cfg.seed, reverse=cfg.reverse)
    if cfg.name == "math":
        return get_task("math", train_data=list(cfg.train_data), eval_data=list(cfg.eval_data),
                        template=cfg.template, reward=cfg.reward, accept_unclosed_answer=cfg.accept_unclosed_answer)
    return get_task(cfg.name)
