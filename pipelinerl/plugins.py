"""Every plug-in name of the project, in one place: tasks, reward rules, policy losses, advantage estimators and
engine kinds.

Each kind of plug-in has one `Registry`. A name maps to its object or to a ``"package.module:attr"`` string of
where it lives, imported on first use (asking for the arithmetic task never imports sympy; the config checks a
name without importing anything). A recipe may also name a plug-in that is not registered at all by its path,
``task.name: my_tasks.sorting:SortingTask``: that is how a plug-in of your own is one file and no edit here.

This module sits below every other one of the package and imports none of them at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownPlugin(KeyError):
    """A name that is neither registered nor an importable ``package.module:attr``; its message says which exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def is_dotted_path(ref: str) -> bool:
    """Whether `ref` reads as ``package.module:attr`` (checked without importing it)."""
    module, sep, attr = ref.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".")) and attr.isidentifier()


def import_ref(ref: str, what: str = "plug-in") -> Any:
    """The object at ``package.module:attr``. UnknownPlugin says what failed: the module's import or the name."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownPlugin(f"{what} {ref!r}: cannot import module {module_name!r} ({e}; is its package on "
                            "PYTHONPATH?)") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UnknownPlugin(f"{what} {ref!r}: module {module_name!r} has no {attr!r}") from None


class Registry(Generic[T]):
    """Names of one kind of plug-in. `builtin_modules` register their plug-ins when imported (a decorator in the
    module, as the losses do); they are imported the first time the registry is read."""

    def __init__(self, kind: str, builtins: dict[str, T | str] | None = None, builtin_modules: Iterable[str] = ()):
        self.kind = kind
        self._entries: dict[str, T | str] = dict(builtins or {})
        self._builtin_modules = tuple(builtin_modules)
        self._loaded = not self._builtin_modules

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._builtin_modules:
                importlib.import_module(module)

    def add(self, name: str, obj: T | str, *, replace: bool = False) -> None:
        """Register `obj` (or the ``"module:attr"`` where it lives) under `name`; a second, different entry under
        one name is an error unless `replace`."""
        old = self._entries.get(name)
        if old is not None and old is not obj and old != obj and not replace:
            raise ValueError(f"a {self.kind} named {name!r} is already registered ({old!r})")
        self._entries[name] = obj

    def remove(self, name: str) -> None:
        """Forget `name` (a test's plug-in, say); a name not registered is no error."""
        self._entries.pop(name, None)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def knows(self, name: str) -> bool:
        """Registered, or a ``package.module:attr`` path (not imported here)."""
        return name in self or is_dotted_path(name)

    def choices(self) -> str:
        """The registered names and the path form, for error messages."""
        return f"{', '.join(self.names())} (or name your own as package.module:attr)"

    def get(self, name: str) -> T:
        """The plug-in `name`, imported if it was registered as a path; a ``package.module:attr`` name is imported
        as such. UnknownPlugin names what exists."""
        self._load_builtins()
        entry = self._entries.get(name)
        if entry is None:
            if ":" not in name:
                raise UnknownPlugin(f"unknown {self.kind} {name!r}; registered: {self.choices()}")
            return import_ref(name, self.kind)
        if isinstance(entry, str):
            entry = import_ref(entry, self.kind)
            self._entries[name] = entry
        return entry

    def items(self) -> list[tuple[str, T]]:
        """Every registered plug-in, imported."""
        return [(name, self.get(name)) for name in self.names()]


# `task.name`: a factory called with the task's settings, returning a pipelinerl.tasks.base.Task
TASKS: Registry[Callable[..., Any]] = Registry("task", {
    "arithmetic": "pipelinerl.tasks.arithmetic:ArithmeticTask",
    "math": "pipelinerl.tasks.math_data:MathTask",
    "code": "pipelinerl.tasks.code:CodeTask",
    "reasoning_gym": "pipelinerl.tasks.reasoning_gym:ReasoningGymTask",
    "mix": "pipelinerl.tasks.mix:MixTask",
    "ifeval": "pipelinerl.tasks.ifeval:IFEvalTask",
    "multiple_choice": "pipelinerl.tasks.multiple_choice:MultipleChoiceTask",
})

# `task.args.reward` of the math task: a scoring function (item -> reward) the reward workers import by its path
REWARD_RULES: Registry[Callable[[dict], Any]] = Registry("reward rule", {
    "math": "pipelinerl.rewards.math:score_math",
    "orz": "pipelinerl.rewards.math:score_orz",
    "orz_exact": "pipelinerl.rewards.orz_exact:score_orz_exact",
})

# `trainer.policy_loss` and `trainer.advantage`: pipelinerl.rl.registry's specs, registered by decorators
POLICY_LOSSES: Registry[Any] = Registry("policy loss", builtin_modules=("pipelinerl.rl.losses",))
ADVANTAGES: Registry[Any] = Registry("advantage estimator", builtin_modules=("pipelinerl.rl.advantages",))

# `engine.kind`: a pipelinerl.contracts.engine.EngineKind (how to serve it, its launch environment, its checks)
ENGINES: Registry[Any] = Registry("engine kind", {
    "embedded": "pipelinerl.engines.embedded.kind:KIND",
    "vllm": "pipelinerl.engines.vllm.kind:KIND",
    "sglang": "pipelinerl.engines.sglang.kind:KIND",
})
