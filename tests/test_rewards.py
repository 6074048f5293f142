"""Reward service: the crash-isolated pool (real worker processes), math answer checking, length shaping."""

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import wait_until

import pipelinerl.rewards.math as rmath
from pipelinerl.config import ConfigError, RewardConfig, load_config
from pipelinerl.rewards import (
    RewardPool,
    RewardResult,
    answers_match,
    choice_reward,
    cosine_length_reward,
    function_ref,
    last_boxed,
    length_penalty_active,
    math_reward,
    orz_exact_reward,
    orz_reward,
    overlong_penalty,
    shape_reward,
    truncated_zero,
)
from pipelinerl.samples import Sample
from pipelinerl.tasks import reward_item, task_from_config
from pipelinerl.tasks.math_data import MathTask

MATH500 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "orz_eval" / "math500.json"

# -- scoring functions run inside pool workers (top-level, so workers can import them) ---------------------------


def check_double(item):
    return float(item["x"] * 2), {"double": 1.0}


def check_hang(item):
    time.sleep(3600)


def check_exit(item):
    os._exit(1)


def check_segfault(item):
    os.kill(os.getpid(), signal.SIGSEGV)


def check_raise(item):
    raise ValueError(f"bad item {item['x']}")


def check_nan(item):
    return math.nan


def check_slow(item):
    time.sleep(item["sleep"])
    return 1.0


def check_after_slow_warmup(item):
    return 1.0


def _slow_warmup():
    time.sleep(3.0)


check_after_slow_warmup.warmup = _slow_warmup


def check_warm_then_maybe_exit(item):
    if item.get("exit"):
        os._exit(1)
    return 1.0, {"pid": float(os.getpid())}


check_warm_then_maybe_exit.warmup = _slow_warmup


def check_by_kind(item):
    return {"ok": check_double, "hang": check_hang, "exit": check_exit, "segv": check_segfault,
            "raise": check_raise}[item["kind"]](item)


def check_pair(item):
    """(gold, answer) through the math verifier, as a reward."""
    ok, reason = answers_match(item["gold"], item["answer"])
    return RewardResult(1.0 if ok else 0.0, {}, reason)


def check_verify_timeout(item):
    rmath.MATH_VERIFY_TIMEOUT_S = 1
    return check_pair(item)


# sympy and math-verify imported before the clock starts, as the project's own math rewards do
check_pair.warmup = check_verify_timeout.warmup = rmath._warmup


def check_memory_hog(item):
    """A verifier that wants far more memory than its worker may have."""
    hog = bytearray(item["mb"] * 1024 * 1024)
    return float(len(hog) > 0)


def check_huge_completion(item):
    """The real rules on a completion of several megabytes."""
    rules = (math_reward(item["problem"], item["completion"]),
             orz_exact_reward(item["problem"], item["completion"], "stop"))
    return RewardResult(sum(r.reward for r in rules), {}, "; ".join(r.info for r in rules))


check_huge_completion.warmup = rmath._warmup


# -- pool ------------------------------------------------------------------------------------------------------


def test_pool_isolates_hangs_crashes_and_errors_and_keeps_scoring():
    with RewardPool(workers=2, timeout_s=3.0) as pool:  # the hang costs this; the quick checks need far less
        assert [r.reward for r in pool.score(check_double, [{"x": i} for i in range(6)])] == [0, 2, 4, 6, 8, 10]
        kinds = ["hang", "ok", "exit", "segv", "raise", "ok"]
        results = pool.score(check_by_kind, [{"kind": k, "x": 7} for k in kinds])
        by_kind = dict(zip(kinds, results))
        assert by_kind["hang"].reward == 0 and by_kind["hang"].info.startswith("timeout"), by_kind["hang"]
        assert by_kind["exit"] == RewardResult(0.0, {}, "crash: exit code 1")
        assert by_kind["segv"] == RewardResult(0.0, {}, "crash: exit code -11")
        assert by_kind["raise"] == RewardResult(0.0, {}, "error: ValueError: bad item 7")
        assert results[1] == results[5] == RewardResult(14.0, {"double": 1.0}, "")
        # replaced workers score correctly afterwards
        assert [r.reward for r in pool.score(check_double, [{"x": i} for i in range(4)])] == [0, 2, 4, 6]
        assert pool.stats() == {"scored": 12, "timeouts": 1, "crashes": 2, "errors": 1, "out_of_memory": 0,
                                "workers_replaced": 3}


def test_a_verifier_out_of_memory_and_a_huge_completion_are_each_handled_and_counted():
    """A check that wants 4 GiB in a worker capped at 768 MiB gets reward 0, counted, and the worker is replaced;
    a 6 MB completion goes through the real math rules within the timeout; the pool keeps scoring."""
    completion = "Let me think. " * 450_000 + "<answer>\\boxed{7}</answer>"
    problem = {"answer": "7"}
    with RewardPool(workers=1, timeout_s=20.0, memory_limit_mb=768) as pool:
        hog = pool.score(check_memory_hog, [{"mb": 4096}])[0]
        assert hog.reward == 0 and hog.info.startswith("out of memory"), hog
        assert pool.score(check_memory_hog, [{"mb": 64}])[0].reward == 1.0  # what fits still runs
        t0 = time.monotonic()
        big = pool.score(check_huge_completion, [{"problem": problem, "completion": completion}])[0]
        assert time.monotonic() - t0 < 20 and big.reward == 2.0, big
        assert [r.reward for r in pool.score(check_double, [{"x": i} for i in range(3)])] == [0, 2, 4]
        stats = pool.stats()
        assert stats["out_of_memory"] == 1 and stats["workers_replaced"] == 1 and stats["scored"] == 5, stats


def test_pool_reports_bad_returns_and_unpicklable_items_as_errors():
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        bad, unpicklable = pool.score(check_nan, [{}])[0], pool.submit(check_double, {"x": lambda: 1}).result()
        assert bad.reward == 0 and bad.info.startswith("error: TypeError") and "nan" in bad.info
        assert unpicklable.reward == 0 and unpicklable.info.startswith("error: cannot send item")
        # in a batch, only the item that cannot be sent is lost
        mixed = pool.score(check_double, [{"x": 1}, {"x": lambda: 1}, {"x": 3}])
        assert [r.reward for r in mixed] == [2.0, 0.0, 6.0] and mixed[1].info.startswith("error: cannot send item")
        assert pool.score("test_rewards:check_double", [{"x": 2}])[0].reward == 4.0  # by "module:name" too
        assert pool.stats()["errors"] == 3 and pool.stats()["workers_replaced"] == 0


def test_pool_warmup_runs_outside_the_timeout():
    with RewardPool(workers=1, timeout_s=2.0) as pool:  # less than the warm-up's 3 s
        assert pool.score(check_after_slow_warmup, [{}, {}]) == [RewardResult(1.0), RewardResult(1.0)]
        assert pool.stats()["timeouts"] == 0


def test_a_batch_goes_on_on_a_fresh_worker_after_a_crash_in_it():
    """A batch is one message to one worker. A crash costs its own item; the items after it are scored by the
    fresh worker, whose warm-up (3 s, more than the 2 s timeout) is again kept off the clock."""
    with RewardPool(workers=1, timeout_s=2.0) as pool:
        first, crashed, after = pool.score(check_warm_then_maybe_exit, [{}, {"exit": True}, {}])
        assert first.reward == 1.0 and crashed == RewardResult(0.0, {}, "crash: exit code 1") and after.reward == 1.0
        assert first.parts["pid"] != after.parts["pid"]  # the fresh worker
        again = pool.submit_batch(check_warm_then_maybe_exit, [{}, {}]).result(timeout=30)
        assert {r.parts["pid"] for r in again} == {after.parts["pid"]}  # warm now: no second warm-up
        assert pool.stats() == {"scored": 4, "timeouts": 0, "crashes": 1, "errors": 0, "out_of_memory": 0,
                                "workers_replaced": 1}


def test_pool_score_async_does_not_block_the_event_loop():
    async def main(pool):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        results = await pool.score_async(check_slow, [{"sleep": 0.4}, {"sleep": 0.4}])
        task.cancel()
        return results, ticks

    with RewardPool(workers=2, timeout_s=5.0) as pool:
        results, ticks = asyncio.run(main(pool))
    assert [r.reward for r in results] == [1.0, 1.0]
    assert ticks >= 10  # the loop kept running while the workers slept


def test_pool_refuses_non_importable_functions_and_stops_on_close():
    with pytest.raises(ValueError, match="top-level"):
        function_ref(lambda item: 1.0)

    def local(item):
        return 1.0

    with pytest.raises(ValueError, match="top-level"):
        function_ref(local)
    assert function_ref(check_double).endswith(":check_double")
    pool = RewardPool(workers=1, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="not running"):
        pool.submit(check_double, {"x": 1})
    with pool:
        in_flight = pool.submit(check_hang, {})
        queued = pool.submit(check_double, {"x": 1})
        wait_until(in_flight.running, "a worker took the hanging check")
    with pytest.raises(RuntimeError, match="closed while the check was running"):
        in_flight.result(timeout=10)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="not running"):
        pool.score(check_double, [{"x": 1}])


def test_apply_result_fills_the_sample():
    from pipelinerl.rewards import apply_result

    s = Sample(group_id="g", prompt_token_ids=[1], output_token_ids=[2], behav_logprobs=[-0.1], versions=[0],
               finish_reason="stop")
    out = apply_result(s, RewardResult(1.0, {"correct": 1.0}, "ok"))
    assert (out.reward, out.reward_parts, out.reward_info, s.reward) == (1.0, {"correct": 1.0}, "ok", 0.0)


# -- math ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{ {a}_{b} + \\sqrt{\\frac{x}{y}} }", " {a}_{b} + \\sqrt{\\frac{x}{y}} "),
    ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),  # escaped braces do not count
    ("\\boxed {42} and \\fbox{43}", "43"),
    ("\\boxed{7} then a truncated \\boxed{\\frac{1}{", "7"),
    ("no answer here", None),
    ("\\boxed{}", ""),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_math_reward_checks_the_last_boxed_answer():
    problem = {"answer": "\\frac{14}{3}"}
    assert math_reward(problem, "... so \\boxed{14/3}", "stop") == RewardResult(1.0, {"correct": 1.0}, "")
    assert math_reward(problem, "\\boxed{14/3} no wait \\boxed{5}", "stop").reward == 0
    wrong = math_reward(problem, "\\boxed{5}", "stop")
    assert wrong.reward == 0 and wrong.parts == {"correct": 0.0} and wrong.info.startswith("wrong answer")
    assert math_reward(problem, "14/3", "stop").info == "no \\boxed{} answer"
    assert math_reward(problem, "\\boxed{ }", "stop").info == "empty \\boxed{} answer"
    assert math_reward(problem, "\\boxed{\\dfrac{14}{3}}", "length").reward == 1.0  # length does not gate here


def test_orz_rule_needs_answer_tags_boxed_and_a_normal_stop():
    problem = {"answer": "\\left( 3, \\frac{\\pi}{2} \\right)"}
    good = "<think> r = 3 </think> <answer> \\boxed{(3, \\frac{\\pi}{2})} </answer>"
    assert orz_reward(problem, good, "stop") == RewardResult(1.0, {"correct": 1.0}, "")
    assert orz_reward(problem, good, "length").info == "did not stop: finish_reason 'length'"
    assert orz_reward(problem, "<think>x</think> \\boxed{(3, \\pi/2)}", "stop").info == "no <answer> block"
    assert orz_reward(problem, "<answer> (3, \\pi/2) </answer>", "stop").info == "no \\boxed{} in <answer>"
    outside = "<answer> see below </answer> \\boxed{(3, \\pi/2)}"
    assert orz_reward(problem, outside, "stop").reward == 0
    assert orz_reward(problem, "<answer> \\boxed{(3, \\pi)} </answer>", "stop").info.startswith("wrong answer")


UNCLOSED = "<think> r = 3 </think> <answer> \\boxed{(3, \\frac{\\pi}{2})}"
CLOSED = UNCLOSED + " </answer>"


def test_orz_rules_score_an_unclosed_answer_block_only_with_the_option():
    """ORZ's rule by default (the engines here keep the stop string "</answer>"): an output that stopped inside an
    unclosed <answer> scores 0, and 1 with `accept_unclosed_answer`; a closed block scores 1 either way. The same
    in ORZ's own check and in multiple choice under the ORZ rule."""
    problem = {"answer": "\\left( 3, \\frac{\\pi}{2} \\right)"}
    strict = orz_reward(problem, UNCLOSED, "stop")
    assert strict.reward == 0.0 and strict.info.startswith("no </answer> after the last <answer>")
    assert orz_reward(problem, UNCLOSED, "stop", accept_unclosed_answer=True) == RewardResult(1.0, {"correct": 1.0})
    assert orz_reward(problem, CLOSED, "stop").reward == orz_reward(problem, CLOSED, "stop", True).reward == 1.0
    # the option closes only a block left open at the end; an output that did not stop still scores 0
    assert orz_reward(problem, UNCLOSED, "length", accept_unclosed_answer=True).reward == 0.0
    assert rmath.close_answer_block(CLOSED) == CLOSED and rmath.close_answer_block("no tags") == "no tags"

    assert orz_exact_reward({"answer": "7"}, "<answer> \\boxed{7}", "stop").reward == 0.0
    assert orz_exact_reward({"answer": "7"}, "<answer> \\boxed{7}", "stop", accept_unclosed_answer=True).reward == 1
    assert orz_exact_reward({"answer": "7"}, "<answer> \\boxed{7} </answer>", "stop").reward == 1.0
    gpqa = {"answer": "D", "choices": {"A": "1", "B": "2", "C": "3", "D": "4"}}
    assert choice_reward(gpqa, "<answer> \\boxed{D}", "stop").reward == 0.0
    assert choice_reward(gpqa, "<answer> \\boxed{D}", "stop", accept_unclosed_answer=True).reward == 1.0
    assert choice_reward(gpqa, "<answer> \\boxed{D} </answer>", "stop").reward == 1.0


def test_accept_unclosed_answer_reaches_the_pool_workers(tmp_path):
    """`task.accept_unclosed_answer` travels on the problems to the math task's scoring function in a worker
    process; the config refuses it where no ORZ rule reads it."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "r?", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)"}) + "\n")
    tasks = {name: MathTask(train_data=[str(data)], reward=rule, accept_unclosed_answer=accept)
             for name, rule, accept in (("strict", "orz", False), ("open", "orz", True),
                                        ("exact_open", "orz_exact", True))}
    items = {name: [reward_item(task.train_problems()[0], text, "stop") for text in (UNCLOSED, CLOSED)]
             for name, task in tasks.items()}
    with RewardPool(workers=1, timeout_s=30) as pool:
        rewards = {name: [r.reward for r in pool.score(tasks[name].reward_fn, items[name])] for name in tasks}
    assert rewards == {"strict": [0.0, 1.0], "open": [1.0, 1.0], "exact_open": [1.0, 1.0]}

    base = [f"run_dir={tmp_path}", "model.path=unused", "task.name=math", f"task.args.train_data=[{data}]"]
    assert task_from_config(load_config(None, [*base, "task.args.accept_unclosed_answer=true"]).task
                            ).accept_unclosed_answer
    with pytest.raises(ConfigError, match="task.args.*accept_unclosed_answer"):
        task_from_config(load_config(None, [*base, "task.args.accept_unclosed_answer=true",
                                            "task.args.reward=math"]).task)
    with pytest.raises(ValueError, match="accept_unclosed_answer"):
        MathTask(train_data=[str(data)], template="boxed", accept_unclosed_answer=True)


@pytest.mark.parametrize("gold, answer, same", [
    ("\\frac{14}{3}", "\\dfrac{14}{3}", True), ("\\frac{14}{3}", "14/3", True), ("\\frac12", "0.5", True),
    ("x=5", "5", True), ("p - q", "-q + p", True), ("3, 5, 7", "7,5,3", True), ("90^\\circ", "90", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True), ("\\text{Evelyn}", "\\text{Evelyn}", True),
    ("10,\\!080", "10080", True), ("3\\sqrt{13}", "\\sqrt{117}", True),
    ("p - q", "q - p", False), ("6 - 5i", "6 + 5i", False), ("(3,4]", "(3,4)", False),
    ("\\text{(C)}", "\\text{(D)}", False),
    ("\\frac{14}{3}", "4.6667", False), ("\\text{Evelyn}", "\\text{Bob}", False), ("42", "43", False),
])
def test_answers_match_equal_and_different_forms(gold, answer, same):
    ok, reason = answers_match(gold, answer)
    assert ok == same, reason
    assert (reason == "") == same


def test_math_verify_timeout_gives_zero_with_reason_inside_a_worker():
    with RewardPool(workers=1, timeout_s=20.0) as pool:
        slow = pool.score(check_verify_timeout, [{"gold": "5", "answer": "9^{9^{9^{9}}}"}])[0]
    assert slow.reward == 0 and "timeout" in slow.info and not slow.info.startswith("timeout"), slow
    assert pool.stats()["timeouts"] == 0  # math-verify's own timeout fired; the worker was not killed


# -- math-verify on real competition answers -------------------------------------------------------------------

_INT_OR_DEC = re.compile(r"^-?(\d+|\d*\.\d+)$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")


def _numeric(gold: str) -> Fraction | None:
    gold = gold.strip()
    if _INT_OR_DEC.match(gold):
        return Fraction(gold)
    m = _FRAC.match(gold)
    return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1) if m else None


def _latex(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    return f"{'-' if v < 0 else ''}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"


def _terminating(v: Fraction) -> bool:
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def rewrites(gold: str) -> list[str]:
    """Forms a model might write that equal `gold`: fraction styles, decimals, spacing, \\left/\\right, degrees,
    "x=" prefixes, thousands separators."""
    out = {gold.replace("\\frac", "\\dfrac"), gold.replace("\\left", "").replace("\\right", ""),
           gold.replace("^\\circ", ""), re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", gold)}
    if re.fullmatch(r"(\\\$)?\d{1,3}(,(\\!)?\s*\d{3})+", gold):  # thousands separators: drop them (spaced, a list)
        out.add(re.sub(r",(\\!)?\s*", "", gold))
    else:
        out |= {gold.replace(", ", ","), re.sub(r",(?=\S)", ", ", gold)}
    out.add(re.sub(r"\\frac\{(\d)\}\{(\d)\}", r"\\frac\1\2", gold))
    v = _numeric(gold)
    if v is not None and v.denominator != 1:
        out.add(f"{v.numerator}/{v.denominator}")
        if _terminating(v):
            out.add(f"{float(v):.12f}".rstrip("0"))
    if v is not None and v.denominator == 1:
        out.add(f"x = {gold}")
    if m := re.fullmatch(r"[a-z]\s*=\s*(.+)", gold):
        out.add(m[1])
    if m := re.fullmatch(r"\\text\{\(?([A-Za-z]+)\)?\}", gold):
        out.add(m[1])
    out.discard(gold)
    return sorted(out)


def wrong_answer(gold: str) -> str:
    """An answer that differs from `gold`: gold + 1 for numbers, else the first digit bumped, else "+1"."""
    v = _numeric(gold)
    if v is not None:
        return _latex(v + 1)
    if m := re.search(r"\d", gold):
        return gold[: m.start()] + str((int(m[0]) + 1) % 10) + gold[m.end():]
    return f"{gold}+1"


@pytest.mark.slow
@pytest.mark.skipif(not MATH500.is_file(), reason=f"development data {MATH500} not present (ORZ MATH-500 eval file)")
def test_math_verify_agrees_on_math500_gold_answers():
    golds = [item["final_answer"] for item in json.loads(MATH500.read_text())]
    assert len(golds) == 500
    same = [{"gold": g, "answer": g} for g in golds]
    rewritten = [{"gold": g, "answer": r} for g in golds for r in rewrites(g)]
    wrong = [{"gold": g, "answer": wrong_answer(g)} for g in golds]
    start = time.monotonic()
    with RewardPool(workers=2, timeout_s=20.0) as pool:
        results = pool.score(check_pair, same + rewritten + wrong)
        stats = pool.stats()
    elapsed = time.monotonic() - start
    r_same, r_rewritten, r_wrong = results[:500], results[500:500 + len(rewritten)], results[500 + len(rewritten):]

    def failures(items, res, want):
        return [(it["gold"], it["answer"], r.info) for it, r in zip(items, res) if (r.reward == 1.0) != want]

    f_same, f_rewritten, f_wrong = failures(same, r_same, True), failures(rewritten, r_rewritten, True), \
        failures(wrong, r_wrong, False)
    self_rate = 1 - len(f_same) / len(same)
    rewrite_rate = 1 - len(f_rewritten) / len(rewritten)
    reject_rate = 1 - len(f_wrong) / len(wrong)
    print(f"\nmath-verify on MATH-500 golds ({elapsed:.1f} s, 2 workers, {stats}):\n"
          f"  self-agreement {self_rate:.4f} ({len(same) - len(f_same)}/{len(same)})\n"
          f"  rewritten forms accepted {rewrite_rate:.4f} ({len(rewritten) - len(f_rewritten)}/{len(rewritten)})\n"
          f"  wrong answers rejected {reject_rate:.4f} ({len(wrong) - len(f_wrong)}/{len(wrong)})")
    for kind, fails in (("self", f_same), ("rewrite", f_rewritten), ("wrong accepted", f_wrong)):
        for gold, answer, info in fails:
            print(f"  {kind} failure: gold {gold!r} answer {answer!r}: {info}")
    assert stats["timeouts"] == stats["crashes"] == stats["errors"] == 0
    assert self_rate >= 0.99, f_same
    assert rewrite_rate >= 0.97, f_rewritten
    assert reject_rate >= 0.99, f_wrong


# -- shaping ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, factor, expected", [
    (100, 1.0, 0.0), (800, 1.0, 0.0), (900, 1.0, -0.5), (950, 0.5, -0.375), (1000, 1.0, -1.0), (1200, 1.0, -1.0),
])
def test_overlong_penalty(length, factor, expected):
    assert overlong_penalty(length, max_len=1000, buffer_len=200, penalty_factor=factor) == pytest.approx(expected)
    assert overlong_penalty(length, max_len=1000, buffer_len=0) == 0.0


@pytest.mark.parametrize("correct, length, expected", [
    (True, 0, 2.0), (True, 500, 1.5), (True, 1000, 1.0), (True, 1500, 1.0),
    (True, 250, 1.0 + 0.5 * (1 + math.sqrt(0.5))),  # cos(pi/4) = sqrt(1/2): 1.853553
    (False, 0, -10.0), (False, 500, -5.0), (False, 1000, 0.0), (False, 750, -10 * 0.5 * (1 - math.sqrt(0.5))),
])
def test_cosine_length_reward(correct, length, expected):
    assert cosine_length_reward(correct, length, 1000) == pytest.approx(expected)


def test_cosine_length_reward_custom_ends():
    assert cosine_length_reward(True, 0, 100, 1.0, 0.5, -1.0, 0.0) == pytest.approx(1.0)
    assert cosine_length_reward(True, 50, 100, 1.0, 0.5, -1.0, 0.0) == pytest.approx(0.75)
    assert cosine_length_reward(False, 50, 100, 1.0, 0.5, -1.0, 0.0) == pytest.approx(-0.5)


def test_length_penalty_schedule():
    assert [length_penalty_active(s, 3, 2) for s in range(8)] == [True, True, True, False, False, True, True, True]
    assert all(length_penalty_active(s, 0, 0) for s in range(5))
    assert not any(length_penalty_active(s, 0, 4) for s in range(5))


def test_truncated_zero():
    assert truncated_zero(1.0, "length") == 0.0 and truncated_zero(1.0, "stop") == 1.0
    assert truncated_zero(-0.5, "abort") == -0.5


def test_shape_reward_combines_terms_in_order():
    off = RewardConfig()
    assert shape_reward(1.0, True, 990, "length", 1000, 0, off) == (1.0, {})
    cfg = RewardConfig(cosine_length=True, cosine_on_steps=2, cosine_off_steps=2, overlong_buffer=200,
                       overlong_penalty=1.0, truncated_zero=True)
    reward, parts = shape_reward(1.0, True, 500, "stop", 1000, step=1, cfg=cfg)  # cosine on, no overlong
    assert reward == pytest.approx(1.5) and parts == pytest.approx({"cosine_length": 0.5, "overlong": 0.0})
    reward, parts = shape_reward(1.0, True, 900, "stop", 1000, step=2, cfg=cfg)  # cosine off, half the buffer
    assert reward == pytest.approx(0.5) and parts == pytest.approx({"overlong": -0.5})
    reward, parts = shape_reward(0.0, False, 1000, "length", 1000, step=2, cfg=cfg)  # truncated: 0 at the end
    assert reward == 0.0 and parts == pytest.approx({"overlong": -1.0, "truncated": 1.0})


def test_cosine_exceed_length_penalty():
    """Yeo et al.'s exceed-length penalty: an output cut off by the limit gets r_exceed (-10), right or wrong,
    instead of the cosine value of its length (0 for a wrong answer at the limit, the best a wrong one can get)."""
    assert cosine_length_reward(False, 1000, 1000, truncated=True) == -10.0
    assert cosine_length_reward(True, 1000, 1000, truncated=True) == -10.0
    assert cosine_length_reward(False, 1000, 1000, truncated=True, r_exceed=-3.0) == -3.0
    assert cosine_length_reward(False, 1000, 1000, truncated=True, r_exceed=None) == pytest.approx(0.0)

    cfg = RewardConfig(cosine_length=True, cosine_on_steps=2, cosine_off_steps=2)
    assert cfg.cosine_r_exceed == -10.0
    reward, parts = shape_reward(0.0, False, 1000, "length", 1000, step=0, cfg=cfg)  # truncated, wrong, cosine on
    assert reward == -10.0 and parts == {"cosine_length": -10.0}
    reward, _ = shape_reward(0.0, False, 999, "stop", 1000, step=1, cfg=cfg)  # long but finished: about 0
    assert reward == pytest.approx(0.0, abs=1e-3) and reward > -10.0
    reward, _ = shape_reward(1.0, True, 1000, "length", 1000, step=1, cfg=cfg)  # truncated, right: -10 too
    assert reward == -10.0
    # the on/off schedule: while the cosine reward is off, a truncated output keeps its task reward
    assert shape_reward(0.0, False, 1000, "length", 1000, step=2, cfg=cfg) == (0.0, {})
    assert shape_reward(1.0, True, 1000, "length", 1000, step=3, cfg=cfg) == (1.0, {})
    # null in the config: truncation is not singled out
    off = load_config(None, ["run_dir=/tmp/unused", "model.path=unused", "reward.cosine_length=true",
                             "reward.cosine_r_exceed=null"]).reward
    assert off.cosine_r_exceed is None
    assert shape_reward(0.0, False, 1000, "length", 1000, step=0, cfg=off)[0] == pytest.approx(0.0)


def test_the_actor_module_imports_without_torch():
    """Reward workers start with `spawn`, which re-imports the parent's main module in every new worker; under the
    actor that is `pipelinerl.actor`. With torch among its imports each replacement of a hung or crashed worker
    took 2 s more of CPU (the whole-run reward test went from 55 to 35 s without it)."""
    code = "import sys, pipelinerl.actor; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout
