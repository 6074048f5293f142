"""Code answers: the last fenced Python block of a completion, run in the sandbox against the problem's tests.

A code problem carries its tests in one normalised form (the loaders in `pipelinerl.tasks.code` build it from
APPS/TACO, CodeContests, HumanEval, MBPP, LiveCodeBench and plain files):

- `{"kind": "stdio", "inputs": [str, ...], "outputs": [str, ...]}`: the program reads case i's input on stdin and
  must print case i's output (APPS/TACO standard input, CodeContests, LiveCodeBench stdin problems). Outputs are
  compared line by line with trailing whitespace stripped from each line and trailing blank lines dropped, the
  whitespace those graders forgive; nothing else is forgiven (no float tolerance, no token-wise compare).
- `{"kind": "function", "test": "<python defining check(candidate)>", "entry_point": "name", "setup": "..."}`
  (HumanEval, MBPP): the program defines `name`, and `check(name)` must return without raising. `setup` (optional)
  is code run before the program and again before the test, e.g. HumanEval's prompt, so helpers the prompt
  defines (`poly` in HumanEval/32) and its imports exist whether or not the answer repeats them.
- `{"kind": "calls", "fn_name": "name", "inputs": [[arg, ...], ...], "outputs": [value, ...], "setup": "...",
  "wrapped_outputs": false}` (APPS/TACO call-based, LiveCodeBench functional): `name(*args)` (or the method of a
  LeetCode-style `class Solution`) must return the JSON value, tuples read as lists. With `wrapped_outputs` (the
  APPS/TACO convention) an expected value given as a one-element list also accepts its element, as APPS's grader
  does.

A problem may also carry `limits` ({"time_limit_s", "memory_mb", "total_time_s"}, see `CodeLimits`) and
`partial: true` for partial credit (the fraction of cases passed instead of 1/0).

Why the function-call harness does not trust exit code 0: a program can `sys.exit(0)` (or `os._exit(0)`) before
any test runs. The harness reads a random nonce from stdin (made in the parent, per run) and writes it, with the
verdict, as the last stdout line only after the tests ran; no such line means the tests did not finish. It also
runs the tests in their own namespace (a program redefining the test's helpers does not change them), restores the
builtins after each call (a program rebinding `abs` does not change how it is judged) and refuses results of
classes defined in Python (an object whose `__eq__` always says True). It is a guard against cheap exploits a policy
can stumble on, not a security boundary against a determined program in the same interpreter (see `_HARNESS`).

Every result says why (`RewardResult.info`): "no code block", "syntax error: ...", "wrong answer on case k
(expected ..., got ...)", "timeout on case k", "memory limit ... on case k", "output limit ... on case k",
"runtime error on case k: <last line of the traceback>"; cases are numbered from 1. `parts` holds `correct` (1/0:
every case passed) and `passed_frac` (cases passed / cases; with all-or-nothing scoring the run stops at the first
failure, so it counts the cases passed before it).
"""

from __future__ import annotations

import json
import re
import secrets
import textwrap
import time
from dataclasses import dataclass, fields

from pipelinerl.rewards.result import RewardResult
from pipelinerl.sandbox import RunResult, SandboxLimits, run_python

TEST_KINDS = ("stdio", "function", "calls")
_PYTHON_TAGS = ("python", "py", "python3", "py3")
_FENCE = re.compile(r"(`{3,})[ \t]*([A-Za-z0-9_+.-]*)[^`]*")  # an opening fence line: ``` and an optional tag
_SHOWN = 60  # characters of expected/got output quoted in a reason


# -- extraction ------------------------------------------------------------------------------------------------


def extract_code(completion: str, allow_unclosed: bool = True) -> str | None:
    """The code of the last fenced block tagged python/py (or, when there is none, the last untagged block), or
    None when there is no block or it is blank.

    Python blocks win over untagged ones because a model often ends with a plain ``` block of sample output after
    its code. Fences are lines starting with three or more backticks (indented fences, as in lists, count; the
    block is dedented); a block closes at a line of at least as many backticks. A last block that never closes
    is taken to the end of the text when `allow_unclosed` (the model ended its output inside the block, e.g. it
    stopped at end-of-sequence without writing the closing fence); it can only be the last thing in the text.
    Callers pass `allow_unclosed=False` for outputs cut off by the length limit, whose unclosed block is
    truncated code: then the last closed block counts.
    """
    blocks: list[tuple[str, list[str], bool]] = []  # (tag, lines, closed)
    fence: str | None = None
    for line in completion.split("\n"):
        stripped = line.strip()
        if fence is None:
            if (m := _FENCE.fullmatch(stripped)) is not None:
                fence = m[1]
                blocks.append((m[2].lower(), [], False))
        elif stripped.startswith(fence) and not stripped.strip("`"):
            blocks[-1] = (blocks[-1][0], blocks[-1][1], True)
            fence = None
        else:
            blocks[-1][1].append(line)
    usable = [b for b in blocks if b[2] or allow_unclosed]
    chosen = [b for b in usable if b[0] in _PYTHON_TAGS] or [b for b in usable if not b[0]]
    if not chosen:
        return None
    code = textwrap.dedent("\n".join(chosen[-1][1])).strip("\n")
    return code + "\n" if code.strip() else None


# -- problem format ----------------------------------------------------------------------------------------------


def check_tests(tests: object, where: str) -> dict:
    """`tests` if it is a well-formed normalised test spec (see the module docstring), else a ValueError that
    starts with `where` (the file and record) and names the field."""
    if not isinstance(tests, dict) or tests.get("kind") not in TEST_KINDS:
        raise ValueError(f"{where}: field 'tests' must be a dict with 'kind' one of {', '.join(TEST_KINDS)}, got "
                         f"{str(tests)[:100]}")
    kind = tests["kind"]
    if kind == "function":
        for key in ("test", "entry_point"):
            if not isinstance(tests.get(key), str) or not tests[key].strip():
                raise ValueError(f"{where}: field 'tests.{key}' must be a non-empty string for function tests")
    else:
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError(f"{where}: fields 'tests.inputs' and 'tests.outputs' must be lists")
        if len(inputs) != len(outputs):
            raise ValueError(f"{where}: field 'tests.outputs' has {len(outputs)} entries but 'tests.inputs' has "
                             f"{len(inputs)}")
        if not inputs:
            raise ValueError(f"{where}: field 'tests.inputs' is empty: a problem needs at least one test case")
        if kind == "stdio" and not all(isinstance(x, str) for x in inputs + outputs):
            raise ValueError(f"{where}: fields 'tests.inputs' and 'tests.outputs' must hold strings for stdio tests")
        if kind == "calls":
            if not isinstance(tests.get("fn_name"), str) or not tests["fn_name"].strip():
                raise ValueError(f"{where}: field 'tests.fn_name' must name the function for calls tests")
            if not all(isinstance(x, list) for x in inputs):
                raise ValueError(f"{where}: field 'tests.inputs' must hold one list of arguments per case")
    if not isinstance(tests.get("setup", ""), str):
        raise ValueError(f"{where}: field 'tests.setup' must be a string of Python code")
    return tests


@dataclass(frozen=True)
class CodeLimits:
    """Per-problem limits. `time_limit_s` is the CPU time of one test case (a function-call run gets it once per
    case), with a wall-clock limit of twice that plus a second (interpreter start-up, a loaded machine);
    `total_time_s` bounds all of a problem's runs, so a check ends before the reward pool's per-check timeout
    (`reward.timeout_s`, set above it) kills its worker."""

    time_limit_s: float = 2.0
    memory_mb: int = 512
    total_time_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"limits.{f.name} must be a positive number, got {value!r}")

    @property
    def wall_s(self) -> float:
        return 2 * self.time_limit_s + 1

    @classmethod
    def of(cls, problem: dict) -> CodeLimits:
        given = problem.get("limits") or {}
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


# -- running -----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What running the tests found: cases passed out of `total`, and the first failure's reason ("" if none)."""

    passed: int
    total: int
    failure: str = ""


def _quote(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


def normalize_output(text: str) -> str:
    """Output as the stdio graders compare it: trailing whitespace off every line, trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.rstrip().split("\n"))


def _case_text(value: str | list) -> str:
    # APPS/TACO occasionally give a case as a list of lines; their grader joins them
    return "\n".join(map(str, value)) if isinstance(value, list) else value


class _Budget:
    """The wall time a problem may still spend (`CodeLimits.total_time_s`), shared by its runs."""

    def __init__(self, limits: CodeLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.total_time_s
        self.capped = False  # whether the last run got less time than its cases' limits: a timeout is the budget's

    def run(self, code: str, stdin: str, cases: int = 1) -> RunResult | None:
        """One sandboxed run with the limits of `cases` test cases (cut to the time left); None if none is left."""
        left = self.deadline - time.monotonic()
        if left <= 0.05:
            return None
        wall = min(self.limits.wall_s * cases, left)
        self.capped = wall < self.limits.wall_s * cases
        limits = SandboxLimits(cpu_s=min(self.limits.time_limit_s * cases, wall), wall_s=wall,
                               memory_mb=int(self.limits.memory_mb))
        result = run_python(code, stdin=stdin, limits=limits)
        if result.status == "sandbox_error":  # our failure, not the program's: an error in the pool's counts
            raise RuntimeError(f"the sandbox could not run the program: {_last_line(result.stderr)}")
        return result

    def spent(self, case: int) -> str:
        return f"timeout on case {case}: the problem's total time budget of {self.limits.total_time_s:g} s is spent"


def _run_failure(result: RunResult, case: int, budget: _Budget) -> str:
    """Why a run that did not produce a verdict failed ("" when it exited 0)."""
    if result.status == "timeout":
        return budget.spent(case) if budget.capped else f"timeout on case {case}"
    limits, last = budget.limits, _last_line(result.stderr)
    if result.status == "memory" or last.startswith("MemoryError"):
        return f"memory limit ({limits.memory_mb:g} MiB) exceeded on case {case}"
    if result.status == "output_limit":
        return f"output limit exceeded on case {case}"
    if result.status == "killed":
        return f"runtime error on case {case}: killed by a signal{f' ({last})' if last else ''}"
    if result.status == "error":
        return f"runtime error on case {case}: {last or f'exit code {result.returncode}'}"
    return ""


def run_stdio(code: str, tests: dict, limits: CodeLimits, partial: bool) -> Outcome:
    """One sandboxed run per case, in order; stops at the first failure unless `partial`."""
    budget = _Budget(limits)
    outcome = Outcome(0, len(tests["inputs"]))
    for case, (stdin, expected) in enumerate(zip(tests["inputs"], tests["outputs"]), 1):
        result = budget.run(code, _case_text(stdin))
        if result is None:
            outcome.failure = outcome.failure or budget.spent(case)
            break
        failure = _run_failure(result, case, budget)
        if not failure:
            want, got = normalize_output(_case_text(expected)), normalize_output(result.stdout)
            if got == want:
                outcome.passed += 1
                continue
            failure = f"wrong answer on case {case} (expected {_quote(want)}, got {_quote(got)})"
        outcome.failure = outcome.failure or failure
        if not partial:
            break
    return outcome


# The function-call harness: a fixed program, so no secret is ever in a file the candidate could read; the nonce,
# the candidate's code and the tests arrive on stdin and stay in this process's memory. Everything the verdict
# depends on (exec, compile, the output call, type checks) is bound before the candidate runs, so rebinding
# builtins or json does not forge a verdict. Honest limits: the candidate runs in this interpreter, so a program
# that searches interpreter memory (the calling frames' locals, gc.get_objects, /proc/self/mem) can find the nonce
# and print a verdict of its own, and one that patches library modules the tests import (math.fabs) can change
# their answers. This stops the cheap exploits a policy can stumble on (exiting early, printing "all tests passed",
# always-equal results, rebinding builtins or the test's helpers), not a determined adversary; that needs the tests
# in a process the candidate's code never runs in.
_HARNESS = r'''
import builtins, collections, fractions, json, os, sys, types


def main(read=sys.stdin.read, loads=json.loads, write=os.write, exit_now=os._exit, compile_=compile, exec_=exec,
         type_=type, str_=str, saved_builtins=dict(builtins.__dict__), live_builtins=builtins.__dict__,
         flags_of=type.__dict__["__flags__"].__get__, name_of=type.__dict__["__name__"].__get__,
         allowed=(collections.Counter, collections.OrderedDict, fractions.Fraction)):
    spec = loads(read())
    nonce = spec.pop("nonce")
    sys.stdin = open(os.devnull)  # the candidate sees an empty stdin
    heap_type = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not a built-in type

    def restore_builtins():
        live_builtins.clear()
        live_builtins.update(saved_builtins)

    def verdict(passed, total, kind="-", case=0, detail=""):
        restore_builtins()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # the program's own output first; the verdict is the last line
            except BaseException:
                pass
        line = "\n" + nonce + " " + str_(passed) + " " + str_(total) + " " + kind + " " + str_(case) + " "
        data = (line + detail.replace("\n", " ")[:300] + "\n").encode()
        while data:
            data = data[write(1, data):]
        exit_now(0)

    def describe(error):
        try:
            text = str_(error)
        except BaseException:
            text = ""
        if type_(error) is AssertionError:  # the test's own message, if it has one, says what was wrong
            return text
        return name_of(type_(error)) + (": " + text if text else "")

    def failure_kind(error):
        if isinstance(error, AssertionError):
            return "wrong"
        if isinstance(error, MemoryError):
            return "memory"
        return "exit" if isinstance(error, SystemExit) else "error"

    def built_in(value, depth=0):
        # a result of a class defined in Python could overload ==, -, abs... to pass any assertion
        cls = type_(value)
        if flags_of(cls) & heap_type and cls not in allowed:
            raise TypeError("the result is an instance of " + name_of(cls) + ", a class defined in Python; only "
                            "built-in types count, so a result cannot fake its comparisons")
        if depth < 50 and (cls is list or cls is tuple or cls is set or cls is frozenset):
            for item in value:
                built_in(item, depth + 1)
        elif depth < 50 and cls is dict:
            for key, item in value.items():
                built_in(key, depth + 1)
                built_in(item, depth + 1)

    def plain(value):
        cls = type_(value)
        if value is None or cls is bool or cls is int or cls is float or cls is str:
            return value
        if cls is list or cls is tuple:
            return [plain(v) for v in value]
        if cls is dict:
            return {plain(k): plain(v) for k, v in value.items()}
        raise TypeError("the result is of type " + name_of(cls) + ", not a JSON value")

    def guarded(target, check_results):
        def call(*args, **kwargs):
            try:
                result = target(*args, **kwargs)
            finally:
                restore_builtins()
            if check_results:
                built_in(result)
            return result
        return call

    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    name = spec.get("entry_point") or spec["fn_name"]
    try:
        setup = compile_(spec.get("setup") or "", "<setup>", "exec")
        exec_(setup, module.__dict__)
    except BaseException as e:
        verdict(0, 1, "setup", 0, describe(e))
    stub = module.__dict__.get(name)
    try:
        exec_(compile_(spec["code"], "solution.py", "exec"), module.__dict__)
        restore_builtins()
        target = module.__dict__.get(name)
        if (target is None or target is stub) and "Solution" in module.__dict__:  # LeetCode style
            target = getattr(module.__dict__["Solution"](), name, None)
        restore_builtins()
    except BaseException as e:
        verdict(0, 1, failure_kind(e), 0, describe(e))
    if target is None or target is stub or not callable(target):
        verdict(0, 1, "missing", 0, "the code does not define " + name)

    if spec["kind"] == "function":
        tests = types.ModuleType("tests")
        call = guarded(target, not isinstance(target, type))
        try:
            exec_(setup, tests.__dict__)
            tests.__dict__[name] = call  # tests that call the function by name (MBPP) get the guarded one too
            exec_(compile_(spec["test"], "<test>", "exec"), tests.__dict__)
            tests.__dict__["check"](call)
        except BaseException as e:
            detail = describe(e)
            if type_(e) is AssertionError and not detail:  # HumanEval's asserts have no message: quote the line
                tb, line = e.__traceback__, 0
                while tb is not None:
                    line = tb.tb_lineno if tb.tb_frame.f_code.co_filename == "<test>" else line
                    tb = tb.tb_next
                detail = spec["test"].split("\n")[line - 1].strip() if line else ""
            verdict(0, 1, failure_kind(e), 1, detail)
        verdict(1, 1)

    call = guarded(target, False)
    outputs, total, passed, first = spec["outputs"], len(spec["inputs"]), 0, None
    for case, args in enumerate(spec["inputs"], 1):
        try:
            got = plain(call(*args))
            want = outputs[case - 1]
            ok = got == want or (spec.get("wrapped_outputs") and type_(want) is list and len(want) == 1
                                 and got == want[0])
            failure = None if ok else ("wrong", "expected " + json.dumps(want)[:60] + ", got " + json.dumps(got)[:60])
        except BaseException as e:
            failure = (failure_kind(e), describe(e))
        if failure is None:
            passed += 1
            continue
        first = first or (failure[0], case, failure[1])
        if not spec.get("partial"):
            break
    if first is None:
        verdict(passed, total)
    verdict(passed, total, first[0], first[1], first[2])


main()
'''


def _read_verdict(stdout: str, nonce: str) -> tuple[int, int, str, int, str] | None:
    """(passed, total, failure kind, case, detail) from the harness's last line, or None without a genuine one."""
    lines = stdout.rstrip("\n").split("\n")
    parts = lines[-1].split(" ", 5)
    if len(parts) < 5 or parts[0] != nonce:
        return None
    try:
        return int(parts[1]), int(parts[2]), parts[3], int(parts[4]), parts[5] if len(parts) > 5 else ""
    except ValueError:
        return None


def run_harness(code: str, tests: dict, limits: CodeLimits, partial: bool) -> Outcome:
    """Function or call tests: one sandboxed run of the harness, which reports through a nonce-tagged last line."""
    total = 1 if tests["kind"] == "function" else len(tests["inputs"])
    nonce = secrets.token_hex(16)  # per run, so no output of an earlier run can pass for a verdict
    spec = {**tests, "nonce": nonce, "code": code, "partial": partial}
    budget = _Budget(limits)
    result = budget.run(_HARNESS, json.dumps(spec), cases=total)
    if result is None:
        return Outcome(0, total, budget.spent(1))
    found = _read_verdict(result.stdout, nonce)
    if found is None:
        failure = _run_failure(result, 1, budget)
        if failure:
            return Outcome(0, total, failure.replace(" on case 1", ""))
        return Outcome(0, total, f"the program exited (code {result.returncode}) before the tests finished; only a "
                                 "completed test run counts")
    passed, total, kind, case, detail = found
    where = " while loading the code" if not case else "" if tests["kind"] == "function" else f" on case {case}"
    reasons = {
        "-": "",
        # calls: "(expected ..., got ...)" as for stdio; function: the failing assert line
        "wrong": f"wrong answer{where}" + ("" if not detail else f" ({detail})" if tests["kind"] == "calls"
                                           else f": {detail}"),
        "error": f"runtime error{where}: {detail}",
        "memory": f"memory limit ({limits.memory_mb:g} MiB) exceeded{where}",
        "exit": f"the program called exit{where} ({detail}); only a completed test run counts",
        "missing": detail,
        "setup": f"the problem's setup code failed: {detail}",
    }
    return Outcome(passed, total, reasons.get(kind, f"{kind}{where}: {detail}"))


def code_reward(problem: dict, completion: str, finish_reason: str = "stop") -> RewardResult:
    """1 when the last code block passes every test case (or the fraction passed, with `problem["partial"]`)."""
    code = extract_code(completion, allow_unclosed=finish_reason != "length")
    if code is None:
        return RewardResult(0.0, {"correct": 0.0, "passed_frac": 0.0}, "no code block")
    try:
        compile(code, "solution.py", "exec")  # compiling runs nothing; a syntax error needs no sandbox
    except (MemoryError, RecursionError):  # a few thousand nested operators exhaust the parser, not the worker
        return RewardResult(0.0, {"correct": 0.0, "passed_frac": 0.0}, "syntax error: too deeply nested to compile")
    except (SyntaxError, ValueError) as e:
        where = f"line {e.lineno}: " if isinstance(e, SyntaxError) and e.lineno else ""
        msg = e.msg if isinstance(e, SyntaxError) else str(e)
        return RewardResult(0.0, {"correct": 0.0, "passed_frac": 0.0}, f"syntax error: {where}{msg}")
    tests, partial = problem["tests"], bool(problem.get("partial"))
    limits = CodeLimits.of(problem)
    runner = run_stdio if tests["kind"] == "stdio" else run_harness
    outcome = runner(code, tests, limits, partial)
    frac = outcome.passed / outcome.total
    correct = float(outcome.passed == outcome.total)
    reward = frac if partial else correct
    info = outcome.failure + (f" ({outcome.passed}/{outcome.total} cases passed)" if partial and not correct else "")
    return RewardResult(reward, {"correct": correct, "passed_frac": frac}, info)


def score_code(item: dict) -> RewardResult:
    """Pool entry point: item = {"problem", "completion", "finish_reason"}."""
    return code_reward(item["problem"], item["completion"], item.get("finish_reason", "stop"))
