"""The package's layers, enforced: a module imports only from its own layer or those below it (imports inside
functions count; those under `if TYPE_CHECKING:` do not, being type hints only). Data and control flow one way:
the contracts at the bottom, the command line at the top. `make lint` runs this with ruff. docs/architecture.md
describes the layers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipelinerl"

# lowest first; a module (or package) of pipelinerl in each
LAYERS: list[list[str]] = [
    ["contracts", "plugins"],  # the inference and trainer contracts, the engine-kind type, the plug-in names
    ["rl", "samples", "models"],  # pure tensor math, the sample record, model building and fetching
    ["config", "config_reference", "cli_args", "auth"],  # the run's settings; argument types; keys and binds
    # the pipes between the processes; the sandbox for model-written programs (the code reward's and the tools')
    ["streams", "weight_sync", "metrics", "procs", "sizing", "sandbox"],
    ["rewards"],  # scoring answers, in worker processes
    ["tasks"],  # problems, prompts and their verifiers; multi-turn rollouts (tasks/workflow.py)
    ["engines", "trainer"],  # the two sides of a weight update
    # process roles
    ["actor", "train", "serve", "eval", "conformance", "data", "data_prorl", "plot", "placement", "nodes"],
    ["launch", "plan", "gpu_setup", "cli"],  # what a user runs
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    hints = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in hints:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("pipelinerl.")]


def _unit(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def test_every_module_has_a_layer():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert units <= set(LEVEL), f"place {sorted(units - set(LEVEL))} in a layer of tests/test_layers.py"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _unit(path)
        if me not in LEVEL:
            continue
        for line, name in _imports(path):
            other = name.split(".")[1]
            if other in LEVEL and LEVEL[other] > LEVEL[me]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({me}, layer {LEVEL[me]}) imports {name} "
                              f"(layer {LEVEL[other]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_contracts_import_no_implementation():
    for path in (PACKAGE / "contracts").rglob("*.py"):
        for line, name in _imports(path):
            assert name.split(".")[1] in ("contracts", "plugins"), f"{path.name}:{line} imports {name}"
