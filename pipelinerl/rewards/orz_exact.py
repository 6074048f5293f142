"""Open-Reasoner-Zero's own answer check (`reward: orz_exact`), rebuilt from its rules.

`math.orz_reward` applies ORZ's *format* rule but judges equality with math-verify. This module reproduces ORZ's
*verdicts*: the same extraction, the same string normalisations and the same sympy comparison, so a run can be
scored exactly as ORZ's training and evaluation were (Open-Reasoner-Zero, `orz/ppo/tools/math_utils.py` and
`custom_reward_fn` in `playground/orz_7b_ppo.py`; the rules, not the code, are reproduced here).

The rule, in order:
1. The output must have stopped by itself (finish_reason "stop"); a truncated output scores 0.
2. Extraction: ORZ takes its answer with the regex `<answer>.*?(\\boxed{.*}).*?</answer>`, so the closing
   `</answer>` must be in the text (ORZ keeps stop strings in the output) and the answer is the last `\\boxed{...}`
   between the *first* `<answer>` and the *last* `</answer>` (braces counted naively, as ORZ does). With ORZ's stop
   strings an output ends at its first `</answer>`, so in practice this is "the last box in the answer block".
3. String check (Hendrycks MATH `is_equiv`): both sides are normalised (`\\dfrac`/`\\tfrac` -> `\\frac`, no
   `\\left`/`\\right`, `^\\circ`, `$`, commas, `\\%`, `\\!`, spaces, a trailing `\\text{ unit}`, a short "x="
   prefix, `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`, `a/b` -> `\\frac{a}{b}`, `0.5` -> `\\frac{1}{2}`),
   then compared as floats when both are numbers, else as strings.
4. Symbolic check (only if 3 failed): answers over 128 characters that are highly repetitive are rejected outright;
   otherwise both sides are parsed with sympy's `parse_latex` (non-strict), evaluated with `evalf`, and equal if the
   expressions or their values are identical. If that fails, both are normalised the Minerva way (units and
   `\\text{}` removed, first `$...$` kept, ...) and checked again; if a side then cannot be parsed, the normalised
   strings are compared. ORZ gives this stage 1 s; here it is bounded the same way (see Timeouts).

Known quirks of ORZ's check, reproduced on purpose (they were in ORZ's training signal): sympy's non-strict parser
reads only a leading expression, so "1,5" equals "1,2" (both read as 1); `\\text{Evelyn}` parses as a product of
letters, so anagrams match; commas are dropped before the string check, so "(1,2)" equals "(12)"; unordered lists
("3, 5, 7" vs "7, 5, 3") and intervals never match in another order. docs/orz_reward_agreement.md measures where
this rule and math-verify disagree.

Parser: ORZ ran sympy's ANTLR-generated LaTeX parser with antlr4-python3-runtime 4.11. This environment has the 4.13
runtime (math-verify's latex2sympy2_extended needs it) and sympy refuses any runtime but 4.11 by a version-string
check. Runtimes from 4.10 on read the same serialized grammar, so `_sympy_parse_latex` lets sympy's parser run on
4.13 (and silences ANTLR's version-mismatch print). Checked against ORZ's own `math_utils.py` run with sympy 1.14 and
antlr4-python3-runtime 4.11 (outside this project): the same verdict on all 3521 cases of
`bench/reward_agreement.py` and on every pair in tests/test_orz_exact.py.

Timeouts: as in `math.py`, a SIGALRM bound (`ORZ_SYMPY_TIMEOUT_S`, ORZ's own 1 s) is used only in a process's main
thread with SIGALRM unused, i.e. in a reward pool worker; a slow sympy evaluation then gives a 0 with a reason.
Elsewhere the pool's per-answer timeout is the bound. A worker parses each gold answer once (it repeats G times per
group), so after a group's first answer the 1 s is the answer's alone, where ORZ's covered both parses.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

from pipelinerl.rewards.math import accepts_unclosed, close_answer_block, judged, shorten, signal_timeout
from pipelinerl.rewards.result import RewardResult

# ORZ waits 1 s for the symbolic stage (asyncio.wait_for around it) and counts a late answer as wrong.
ORZ_SYMPY_TIMEOUT_S = 1.0
# ORZ skips the symbolic stage for long, repetitive strings (degenerate outputs that would be slow to parse).
REPEAT_MIN_CHARS = 128
REPEAT_MAX_SHARE = 0.2


class SympyTimeout(BaseException):
    """Raised by the alarm. A BaseException, so the `except Exception` fallbacks of the rule cannot swallow it."""


# -- extraction ------------------------------------------------------------------------------------------------


def _naive_closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` that brings the brace count back to 0, counting from `start`; escaped braces count too
    (ORZ's scan does not skip `\\{`). None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def unbox(text: str) -> str:
    """The content of the last `\\boxed{...}` in `text`; `text` itself when there is no complete one.

    That fallback is ORZ's: a gold answer without a box is used as it is, and an extracted answer whose last box
    is unclosed (or written `\\boxed {x}`) is compared as the whole extracted text, which then practically never
    matches.
    """
    # ORZ falls back to the last `\fbox` when there is no `\boxed`, but then cannot unbox it (it wants
    # "\boxed{") and keeps the text: the same as ignoring `\fbox` here
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return text
    end = _naive_closing_brace(text, start)
    return text if end is None else text[start + len("\\boxed{"):end]


def orz_extract(completion: str) -> tuple[str | None, str]:
    """ORZ's answer from an output: (answer, "") or (None, why there is none). See the module docstring, step 2."""
    first = completion.find("<answer>")
    if first < 0:
        return None, "no <answer> block"
    first += len("<answer>")
    last = completion.rfind("</answer>")
    if last < first:
        # an engine that drops the stop string from the output would land here for every answer
        return None, "no </answer> after <answer> (ORZ needs the closed block)"
    span = completion[first:last]
    box = span.find("\\boxed{")
    close = span.rfind("}")
    if box < 0 or close < box + len("\\boxed{"):
        return None, "no \\boxed{} in <answer>"
    return unbox(span[box:close + 1]), ""


# -- string check (Hendrycks MATH `is_equiv`) ------------------------------------------------------------------


def _drop_unit_suffix(s: str) -> str:
    """`"5 \\text{ cm}"` -> `"5 "`. More than one `\\text{ ` is an error: ORZ then falls back to raw equality."""
    parts = s.split("\\text{ ")
    if len(parts) > 2:
        raise ValueError("several '\\text{ ' groups")
    return parts[0]


def _brace_sqrt_args(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`: a brace-less argument is the next single character. `\\sqrt` at the very end (or
    straight before another `\\sqrt`) is an error, as in ORZ."""
    head, *tails = s.split("\\sqrt")
    out = [head]
    for tail in tails:
        if not tail:
            raise ValueError("\\sqrt without an argument")
        out.append("\\sqrt" + (tail if tail[0] == "{" else "{" + tail[0] + "}" + tail[1:]))
    return "".join(out)


def _brace_frac_args(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`: brace-less arguments are single characters.
    A `\\frac` followed by one character leaves the whole string as it was; one at the very end is an error (ORZ
    then compares the raw strings)."""
    head, *tails = s.split("\\frac")
    out = [head]
    for tail in tails:
        if not tail:
            raise ValueError("\\frac without arguments")
        if tail.startswith("{"):
            out.append("\\frac" + tail)
            continue
        if len(tail) < 2:
            return s
        num, den, rest = tail[0], tail[1], tail[2:]
        out.append("\\frac{" + num + "}" + (den + rest if den == "{" else "{" + den + "}" + rest))
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    """`"3/4"` -> `"\\frac{3}{4}"`, only for two plain integers written exactly so."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if s == f"{num}/{den}" else s


def hendrycks_normalize(s: str) -> str:
    """The MATH-benchmark string normalisation ORZ applies first (may raise; the caller falls back)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\$", ""), ("$", ""), (",", "")):
        s = s.replace(old, new)
    s = _drop_unit_suffix(s).replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs_rhs = s.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:  # "k = 5", "x=5": keep the value
        s = lhs_rhs[1]
    s = _brace_sqrt_args(s).replace(" ", "")
    s = _brace_frac_args(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def strings_equivalent(gold: str, answer: str) -> bool:
    """ORZ's first check: normalised strings equal as floats (when both are numbers) or as text."""
    try:
        a, b = hendrycks_normalize(gold), hendrycks_normalize(answer)
    except Exception:  # a malformed answer: ORZ compares the raw strings then
        return gold == answer
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


# -- symbolic check (Minerva normalisation + sympy) ------------------------------------------------------------

# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix), as ORZ uses it: plain substitutions, then
# words and commands deleted, in this order.
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_DELETIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
    "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
    "\\dots",
)
_MINERVA_PATTERNS = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), r"$\2$"),  # keep the first $...$ of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrta -> \sqrt{a}
)


def minerva_normalize(s: str) -> str:
    """Minerva's normalisation of a final answer, the fallback form of ORZ's symbolic check."""
    for old, new in _MINERVA_SUBSTITUTIONS:
        s = s.replace(old, new)
    for word in _MINERVA_DELETIONS:
        s = s.replace(word, "")
    for pattern, replacement in _MINERVA_PATTERNS:
        s = pattern.sub(replacement, s)
    s = s.replace("$", "")
    return s.replace(",", "") if s.replace(",", "").isdigit() else s  # 100,000 -> 100000


@functools.cache
def _sympy_parse_latex() -> Callable[[str], Any]:
    """sympy's ANTLR LaTeX parser (ORZ's), made to run on the installed ANTLR runtime; see the module docstring."""
    from sympy.parsing.latex import _parse_latex_antlr as antlr_latex
    from sympy.parsing.latex import parse_latex

    runtime = importlib.metadata.version("antlr4-python3-runtime")
    if not runtime.startswith("4.11"):
        major, minor = (int(x) for x in runtime.split(".")[:2])
        if (major, minor) < (4, 10):
            raise ImportError(f"orz_exact needs antlr4-python3-runtime >= 4.10 for sympy's LaTeX parser, "
                              f"found {runtime}")
        if antlr_latex.LaTeXParser is None or antlr_latex.LaTeXLexer is None:
            raise ImportError("sympy's generated LaTeX parser could not be imported")
        real_version = antlr_latex.version
        # sympy compares this string with "4.11"; the grammar it ships loads on any runtime from 4.10
        antlr_latex.version = lambda dist: "4.11" if dist == "antlr4-python3-runtime" else real_version(dist)
        for generated in (antlr_latex.LaTeXParser, antlr_latex.LaTeXLexer):
            generated.checkVersion = lambda self, version: None  # it would print a warning on every parse
    return parse_latex


def _parsed(latex: str) -> tuple[Any, Any]:
    """(expression, `evalf` value) of `latex` by sympy's LaTeX parser; an exception when it does not parse."""
    expr = _sympy_parse_latex()(latex)
    return expr, expr.evalf()


@functools.lru_cache(maxsize=4096)
def _parsed_gold(gold: str) -> tuple[Any, Any] | None:
    """`_parsed` for a gold answer, None when it does not parse. Gold answers repeat G times per group (raw and in
    Minerva form) and parsing is most of this rule's time: once per worker, as math.py does. A timeout
    (SympyTimeout, a BaseException) is not caught, so not cached."""
    try:
        return _parsed(gold)
    except Exception:
        return None


def _same_value(gold: str, answer: str) -> bool:
    """Both parse (else an exception) and are identical as expressions or as evaluated values."""
    gold_parsed = _parsed_gold(gold)
    if gold_parsed is None:
        raise ValueError(f"sympy cannot parse the gold answer {gold!r}")
    gold_expr, gold_value = gold_parsed
    answer_expr, answer_value = _parsed(answer)
    return bool(gold_expr == answer_expr or gold_value == answer_value)


def symbolically_equal(gold: str, answer: str) -> bool:
    """ORZ's second check: sympy on the raw strings, then on their Minerva forms, then those forms as strings."""
    try:
        if _same_value(gold, answer):
            return True
    except Exception:  # unparsable: try the normalised forms
        pass
    gold_norm, answer_norm = minerva_normalize(gold), minerva_normalize(answer)
    try:
        return _same_value(gold_norm, answer_norm)
    except Exception:
        return gold_norm == answer_norm


def distinct_substrings(s: str) -> int:
    """Number of distinct non-empty substrings of `s`, with a suffix automaton (linear in len(s))."""
    length, link, edges = [0], [-1], [{}]
    last = 0
    for ch in s:
        cur = len(length)
        length.append(length[last] + 1)
        link.append(0)
        edges.append({})
        p = last
        while p != -1 and ch not in edges[p]:
            edges[p][ch] = cur
            p = link[p]
        if p != -1:
            q = edges[p][ch]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                edges.append(dict(edges[q]))
                while p != -1 and edges[p].get(ch) == q:
                    edges[p][ch] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        last = cur
    return sum(length[v] - length[link[v]] for v in range(1, len(length)))


def repeated_share(s: str) -> float:
    """Share of the n(n+1)/2 substring positions of `s` whose substring occurs earlier in suffix order: ORZ's
    repetition score (the sum of the LCP array over n(n+1)/2), i.e. 1 - distinct substrings / all substrings."""
    n = len(s)
    if n <= 1:
        return 0.0
    total = n * (n + 1) // 2
    return (total - distinct_substrings(s)) / total


def is_repetitive(s: str) -> bool:
    return len(s) > REPEAT_MIN_CHARS and repeated_share(s) > REPEAT_MAX_SHARE


# -- timeout ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise SympyTimeout in the body after `seconds` where the alarm is usable; no bound elsewhere. Usable is
    where math.py lets math-verify use it: a process's main thread with SIGALRM unused (a reward pool worker)."""
    if signal_timeout() is None:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise SympyTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the rule --------------------------------------------------------------------------------------------------


def orz_answers_equal(gold: str, answer: str, timeout_s: float = ORZ_SYMPY_TIMEOUT_S) -> tuple[bool, str]:
    """ORZ's `is_equal` on a gold answer and an extracted answer (both already unboxed): (equal, why not)."""
    if strings_equivalent(gold, answer):
        return True, ""
    wrong = f"wrong answer: {shorten(answer)!r}, expected {shorten(gold)!r}"
    try:
        with _time_limit(timeout_s):
            if is_repetitive(gold) or is_repetitive(answer):
                return False, f"repetitive answer (ORZ skips the symbolic check): {shorten(answer)!r}"
            return (True, "") if symbolically_equal(gold, answer) else (False, wrong)
    except SympyTimeout:
        return False, f"sympy timeout after {timeout_s:g} s: {shorten(answer)!r}"


def orz_exact_reward(problem: dict, completion: str, finish_reason: str,
                     accept_unclosed_answer: bool = False) -> RewardResult:
    """1 when an output that stopped has ORZ's answer equal to `problem["answer"]` under ORZ's check, else 0 with
    the reason in `info`. `accept_unclosed_answer` (not ORZ's rule; for an engine that drops the stop string): an
    unclosed last <answer> block is read as closed at the end of the output (`math.close_answer_block`)."""
    if finish_reason != "stop":
        return judged(False, f"did not stop: finish_reason {finish_reason!r}")
    answer, why = orz_extract(close_answer_block(completion) if accept_unclosed_answer else completion)
    if answer is None:
        return judged(False, why)
    if not answer.strip():
        return judged(False, "empty \\boxed{} answer")
    return judged(*orz_answers_equal(unbox(str(problem["answer"])), answer))


def score_orz_exact(item: dict) -> RewardResult:
    """Pool entry point for `orz_exact_reward`: item = {"problem", "completion", "finish_reason"}; the problem's
    `accept_unclosed_answer` (`math.UNCLOSED_KEY`) switches on the option of that name."""
    return orz_exact_reward(item["problem"], item["completion"], item["finish_reason"],
                            accept_unclosed_answer=accepts_unclosed(item["problem"]))


def warmup() -> None:
    """Import sympy and load the parser: its first parses build ANTLR's tables (over a second on a cold process),
    which must not count against the first answer's time limit nor be interrupted half-built by it."""
    symbolically_equal("\\frac{1}{2}", "\\sqrt{1/4}")
    symbolically_equal("(1, 2)", "\\text{(1, 2)}")


score_orz_exact.warmup = warmup  # type: ignore[attr-defined]  # run by reward pool workers, see pool._worker_main
