"""Math answer checking with math-verify: the last \\boxed{} answer against a LaTeX gold answer.

Two rules:
- `math_reward`: 1 when the last \\boxed{...} in the completion equals the gold answer, else 0.
- `orz_reward`: the Open-Reasoner-Zero rule: the answer must be a \\boxed{} inside <answer>...</answer>, and the
  generation must have stopped by itself (finish_reason "stop"); a truncated output scores 0 whatever it says.

An unclosed last <answer> block scores 0 under the ORZ rules (here and in `orz_exact`, `choice`), as in ORZ: its
engine keeps the stop string "</answer>" in the output, and so do this project's engines (`sampling.stop`; the
SGLang and vLLM fronts ask for it with `no_stop_trim` / `include_stop_str_in_output`), so an output that stopped on
"</answer>" has it. For outputs from an engine that drops the stop string, `task.args.accept_unclosed_answer` scores
such a block as if "</answer>" followed (`close_answer_block`); the math task puts the setting on every problem
(`UNCLOSED_KEY`), which is how it reaches the pool workers with the item.

Every 0 carries its reason in `RewardResult.info` ("no \\boxed{} answer", "wrong answer: ...", ...), because a
reward curve stuck at 0 is only debuggable if you can see why.

Timeouts: math-verify bounds parsing and each comparison with SIGALRM, which only works in a process's main
thread (elsewhere it raises ValueError) and takes over the process's one alarm. The reward pool runs checks in
its workers' main threads, where nothing else uses SIGALRM, so the signal timeout is used there (a slow sympy
simplification becomes a 0 with a reason instead of a killed worker); anywhere else it is switched off and the
pool's per-answer timeout is the only bound.
"""

from __future__ import annotations

import functools
import itertools
import re
import signal
import threading
from typing import Any

from pipelinerl.rewards.result import RewardResult

# Seconds per parse and per comparison for math-verify's own signal timeout. One slow answer costs about two of
# these (parse, then the one sympy-to-sympy comparison), kept below the pool's default 5 s per answer so a slow
# check ends as a 0 with a reason rather than a killed worker.
MATH_VERIFY_TIMEOUT_S = 2

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none.

    Nested braces are kept (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`), escaped braces (`\\{`) do not count,
    and a \\boxed{ that never closes (a truncated output) is skipped.
    """
    found, pos = None, 0
    while (m := _BOXED.search(text, pos)) is not None:
        end = _closing_brace(text, m.end())
        if end is None:
            pos = m.end()
            continue
        found, pos = text[m.end():end], end + 1
    return found


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the brace closing the group opened just before `start`, or None if it never closes."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def answer_block(completion: str) -> str | None:
    """Text of the last <answer>...</answer> block; None when there is no <answer> or the last one is unclosed."""
    start = completion.rfind("<answer>")
    if start < 0:
        return None
    start += len("<answer>")
    end = completion.find("</answer>", start)
    return None if end < 0 else completion[start:end]


# The problem key carrying `task.args.accept_unclosed_answer` to the pool entry points of the ORZ rules.
UNCLOSED_KEY = "accept_unclosed_answer"


def close_answer_block(completion: str) -> str:
    """`completion` with "</answer>" appended when its last <answer> block is unclosed: the text an engine that
    keeps the stop string would have returned. Unchanged otherwise."""
    start = completion.rfind("<answer>")
    if start >= 0 and completion.find("</answer>", start) < 0:
        return completion + "</answer>"
    return completion


def accepts_unclosed(problem: dict) -> bool:
    """Whether `task.args.accept_unclosed_answer` is on for this problem (see the module docstring)."""
    return bool(problem.get(UNCLOSED_KEY, False))


def signal_timeout() -> int | None:
    """math-verify's SIGALRM timeout where it works and harms no one: in the main thread, with SIGALRM unused
    (a pool worker). Elsewhere (another thread, or a process with its own SIGALRM handler such as pytest-timeout)
    it is off, and the pool's per-answer timeout is the bound."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        return None
    return MATH_VERIFY_TIMEOUT_S if signal.getsignal(signal.SIGALRM) is signal.SIG_DFL else None


def _parse(latex: str) -> list[Any]:
    from math_verify import LatexExtractionConfig, parse

    return parse(latex, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                 parsing_timeout=signal_timeout(), raise_on_error=True)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    """Gold answers repeat G times per group; parsing them once per worker saves most of the sympy time."""
    return _parse(f"${gold}$")


def answers_match(gold: str, answer: str) -> tuple[bool, str]:
    """Whether `answer` (the LaTeX inside a \\boxed{}) equals `gold`; the reason when it does not.

    Gold goes in as $gold$ and the answer as \\boxed{answer}, the forms math-verify's LaTeX extraction expects.
    Each parsed form of the gold is compared with each parsed form of the answer (as `verify` does on lists), one
    pair at a time, so that a timeout or an error in one comparison is reported but cannot hide a match in another.
    """
    if not answer.strip():
        return False, "empty \\boxed{} answer"
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = _parse_gold(gold.strip())
        answer_parsed = _parse(f"\\boxed{{{answer}}}")
    except TimeoutException:
        return False, "math-verify timeout while parsing"
    except Exception as e:
        return False, f"math-verify parse error: {type(e).__name__}: {shorten(str(e))}"
    if not gold_parsed:
        return False, f"math-verify cannot parse the gold answer {gold!r}"
    if not answer_parsed:
        return False, f"math-verify cannot parse the answer {shorten(answer)!r}"
    problem = ""
    for g, a in itertools.product(gold_parsed, answer_parsed):
        try:
            if verify(g, a, timeout_seconds=signal_timeout(), raise_on_error=True):
                return True, ""
        except TimeoutException:
            problem = problem or "math-verify timeout"
        except Exception as e:
            problem = problem or f"math-verify error: {type(e).__name__}: {shorten(str(e))}"
    return False, problem or f"wrong answer: {shorten(answer)!r}, expected {gold!r}"


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gold_answer(problem: dict) -> str:
    return str(problem["answer"])


def judged(ok: bool, reason: str) -> RewardResult:
    return RewardResult(1.0 if ok else 0.0, {"correct": 1.0 if ok else 0.0}, reason)


def math_reward(problem: dict, completion: str, finish_reason: str = "stop") -> RewardResult:
    """1 when the last \\boxed{} answer equals `problem["answer"]`. `finish_reason` does not gate the reward here
    (use `orz_reward`, or `shaping.truncated_zero`, for that); it is part of the signature all rules share."""
    answer = last_boxed(completion)
    if answer is None:
        return judged(False, "no \\boxed{} answer")
    return judged(*answers_match(gold_answer(problem), answer))


def orz_reward(problem: dict, completion: str, finish_reason: str,
               accept_unclosed_answer: bool = False) -> RewardResult:
    """Open-Reasoner-Zero: reward only a correct \\boxed{} inside <answer>...</answer> of an output that stopped.

    `accept_unclosed_answer`: an unclosed last <answer> block counts as closed at the end of the output (for an
    engine that drops the stop string "</answer>"); off, such a block scores 0, as in ORZ."""
    if finish_reason != "stop":
        return judged(False, f"did not stop: finish_reason {finish_reason!r}")
    if accept_unclosed_answer:
        completion = close_answer_block(completion)
    block = answer_block(completion)
    if block is None:
        if "<answer>" in completion:
            return judged(False, "no </answer> after the last <answer> (an engine that drops the stop string "
                                 "needs task.args.accept_unclosed_answer)")
        return judged(False, "no <answer> block")
    answer = last_boxed(block)
    if answer is None:
        return judged(False, "no \\boxed{} in <answer>")
    return judged(*answers_match(gold_answer(problem), answer))


def score_math(item: dict) -> RewardResult:
    """Pool entry point for `math_reward`: item = {"problem", "completion", "finish_reason"}."""
    return math_reward(item["problem"], item["completion"], item.get("finish_reason", "stop"))


def score_orz(item: dict) -> RewardResult:
    """Pool entry point for `orz_reward`: item = {"problem", "completion", "finish_reason"}; the problem's
    `accept_unclosed_answer` (`UNCLOSED_KEY`) switches on the option of that name."""
    return orz_reward(item["problem"], item["completion"], item["finish_reason"],
                      accept_unclosed_answer=accepts_unclosed(item["problem"]))


def _warmup() -> None:
    """Import math-verify and sympy and run one check, so a fresh worker's first real answer is not slow."""
    answers_match("\\frac{1}{2}", "1/2")


score_math.warmup = _warmup  # type: ignore[attr-defined]  # run by reward pool workers, see pool._worker_main
score_orz.warmup = _warmup  # type: ignore[attr-defined]
