"""How often ORZ's own check (`orz_exact`) and the math-verify ORZ rule (`orz`) agree, on constructed outputs.

    python -m bench.reward_agreement [DATA_DIR] --out docs/orz_reward_agreement.md [--workers 2]

DATA_DIR (default ../shared/data/orz_eval) holds ORZ's `math500.json` and `aime2024.json`. Every gold answer is put
back into an ORZ-format output, and around it are built:
- gold: `<answer> \\boxed{gold} </answer>`, which both rules should accept;
- rewrite: the gold written another way that is still equal (`\\dfrac`, `0.5` for `\\frac12`, `\\left(...\\right)`,
  spaces, `x = 3`, `^\\circ`, `\\text{ cm}`, reordered sums and unordered lists, ...), expected accepted;
- wrong: another problem's gold; near_miss: the gold with its last digit changed; both expected rejected;
- format: the right answer in an unusual but valid output (two <answer> tags, text after the box, a corrected box);
- malformed: no answer block, unclosed box, empty box, box outside the block, truncated (finish_reason "length"),
  no closing </answer>; all expected rejected under ORZ's rules.
"Expected" is the verdict ORZ's rules intend, by construction; the report counts, per kind, how often each rule
reaches it and lists every case where the two rules disagree. Both rules run in reward pool workers, as in
training, so their timeouts are the production ones.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from pipelinerl.rewards.pool import RewardPool, resolve
from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.math_data import load_file

DEFAULT_DATA_DIR = Path("../shared/data/orz_eval")
KINDS = ("gold", "rewrite", "wrong", "near_miss", "format", "malformed")
EXPECTED = {"gold": True, "rewrite": True, "wrong": False, "near_miss": False, "format": True, "malformed": False}
RULES = {"orz_exact": "pipelinerl.rewards.orz_exact:score_orz_exact",
         "math_verify": "pipelinerl.rewards.math:score_orz"}


# Rewrites that every integer answer gets and on which the rules disagree every time: built for every n-th problem
# only, so that a few hundred identical rows do not bury the other disagreements in the report.
SAMPLED_REWRITES = {"trailing_period": 5}
# Why the rules part ways, per variant (printed for the variants that do disagree).
CAUSES = {
    "trailing_period": "ORZ compares numbers as floats (`float('9.') == 9`); math-verify does not read `9.` as 9.",
    "no_closing_answer_tag": "ORZ's regex needs the closing `</answer>` (ORZ keeps the stop string); the `orz` rule "
                             "accepts an unclosed last block only with task.accept_unclosed_answer (off here), for "
                             "engines that drop the stop string.",
    "reordered_list": "ORZ compares lists as strings (after dropping commas and spaces): another order is wrong; "
                      "math-verify compares them as sets.",
    "last_digit": "sympy's non-strict `parse_latex` reads only a leading expression (`1,-3` as 1, `11\\sqrt3` as "
                  "11, `x \\in [-2,8]` as x*in), so ORZ accepts an answer whose first part matches; math-verify "
                  "rounds decimals, so it takes `.0000673` for `.0000672` (which ORZ's sympy cannot parse).",
    "inline_slash": "sympy cannot parse tuples or intervals, so ORZ compares them as strings: `\\pi/2` is not "
                    "`\\frac{\\pi}{2}` there; math-verify parses both.",
    "slash": "ORZ's sympy cannot parse a decimal without its leading 0 (`.35625`), so only the string check is left; "
             "math-verify reads both as numbers.",
    "no_thousands_sep": "ORZ drops commas and spaces before comparing; math-verify reads `11 111 111 100` as a "
                        "product.",
    "base_subscript": "Both rules accept a number in another base (`52_9` for `52_8`): sympy's parser stops at the "
                      "`_`, and math-verify drops the subscript.",
    "spaces": "ORZ drops commas and spaces before comparing; math-verify reads `58, 500` as a list.",
}


@dataclass(frozen=True)
class Gold:
    id: str
    answer: str
    problem: str


@dataclass(frozen=True)
class Case:
    kind: str
    variant: str
    problem_id: str
    gold: str
    answer: str  # what the output offers, for the report
    completion: str
    finish_reason: str
    expected: bool


def load_golds(data_dir: str | Path) -> list[Gold]:
    """MATH-500 then AIME 2024 gold answers from ORZ's eval files (ids "math500-0", ...: the files have none)."""
    return [Gold(p["id"], p["answer"], p["problem"])
            for name in ("math500", "aime2024") for p in load_file(Path(data_dir) / f"{name}.json")]


# -- equal rewrites --------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?(\d+|\d*\.\d+)")
_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_UNITS = ("cm", "inches", "meters", "feet", "miles", "dollars", "cents", "hours", "minutes", "seconds",
          "square units", "units", "degrees")


def _value(gold: str) -> Fraction | None:
    if _NUMBER.fullmatch(gold):
        return Fraction(gold)
    if m := _FRACTION.fullmatch(gold):
        return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)
    return None


def _decimal(v: Fraction) -> str | None:
    """The exact decimal of a fraction whose denominator has only the factors 2 and 5."""
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return None if d != 1 else f"{float(v):.12f}".rstrip("0").rstrip(".")


def _top_level_split(text: str, seps: str) -> list[str] | None:
    """`text` split at `seps` characters outside braces/brackets/parentheses, keeping each separator at the start
    of the part it begins; None for an unbalanced string."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth < 0:
                return None
        elif c in seps and depth == 0 and i > 0 and text[i - 1] not in "^_{(":
            parts.append(text[start:i])
            start = i
    parts.append(text[start:])
    return parts if depth == 0 else None


def _reordered_sum(gold: str) -> str | None:
    """The terms of a top-level sum in reverse order: "p - q" -> "-q + p"."""
    if any(tok in gold for tok in ("=", ",", "\\pm", "\\begin", "\\text", "_", "\\infty", "\\cup", "<", ">")):
        return None
    terms = _top_level_split(gold.replace(" ", ""), "+-")
    if terms is None or len(terms) < 2 or not all(t.strip("+-") for t in terms):
        return None
    signed = [(t[0], t[1:]) if t[0] in "+-" else ("+", t) for t in reversed(terms)]
    head = ("-" if signed[0][0] == "-" else "") + signed[0][1]
    return head + "".join(f" {sign} {term}" for sign, term in signed[1:])


def _reordered_list(gold: str) -> str | None:
    """An unordered list of solutions in reverse order: "3, 5, 7" -> "7, 5, 3" (not a tuple, not 10,\\!080)."""
    if gold[:1] in "([" or "\\!" in gold or "{,}" in gold or re.fullmatch(r"\d{1,3}(,\d{3})+", gold):
        return None
    items = _top_level_split(gold, ",")
    if items is None or len(items) < 2:
        return None
    items = [items[0]] + [t[1:] for t in items[1:]]
    return ", ".join(t.strip() for t in reversed(items))


def _atom(text: str) -> str:
    """`text` as one operand of `/`: parenthesised unless it is a number, a name or a single command."""
    return text if re.fullmatch(r"-?[\w.]+|\\[a-zA-Z]+", text.strip()) else f"({text})"


def rewrites(gold: str, problem: str) -> list[tuple[str, str]]:
    """(variant, answer) pairs that equal `gold` written another way."""
    out: dict[str, str] = {}
    if "\\frac" in gold:
        out["dfrac"] = gold.replace("\\frac", "\\dfrac")
    if "\\dfrac" in gold:
        out["frac_for_dfrac"] = gold.replace("\\dfrac", "\\frac")
    if "\\left" in gold:
        out["no_left_right"] = gold.replace("\\left", "").replace("\\right", "")
    elif gold[:1] in "([" and gold[-1:] in ")]":
        out["left_right"] = f"\\left{gold[0]} {gold[1:-1]} \\right{gold[-1]}"
    if ", " in gold:
        out["no_spaces"] = gold.replace(", ", ",")
    elif re.search(r",(?=\S)", gold) and "\\!" not in gold and not re.fullmatch(r"\d{1,3}(,\d{3})+", gold):
        out["spaces"] = re.sub(r",(?=\S)", ", ", gold)
    elif re.search(r"[^\s{(^_][+\-=][^\s]", gold):
        out["spaces"] = re.sub(r"(?<=[^\s{(^_])([+\-=])(?=\S)", r" \1 ", gold)
    if m := re.fullmatch(r"[a-z]\s*=\s*(.+)", gold):
        out["drop_lhs"] = m[1]
    v = _value(gold)
    if v is not None:
        out["x_equals"] = f"x = {gold}"
        if v.denominator != 1:
            out["slash"] = f"{v.numerator}/{v.denominator}"
            if (dec := _decimal(v)) is not None:
                out["decimal"] = dec
        elif "." in gold:
            out["fraction"] = f"{'-' if v < 0 else ''}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"
        if v.denominator == 1 and abs(v) >= 1000 and "," not in gold:
            out["thousands"] = f"{int(v):,}"
        if re.search(r"\bdegrees?\b", problem) and "\\circ" not in gold:
            out["degree_sign"] = f"{gold}^\\circ"
        unit = next((u for u in _UNITS if re.search(rf"\b{u}\b", problem)), None)
        if unit is not None:
            out["unit_text"] = f"{gold} \\text{{ {unit}}}"
        if "\\$" in problem or re.search(r"\bdollars?\b", problem):
            out["dollar_sign"] = f"\\${gold}"
    if "^\\circ" in gold or "^{\\circ}" in gold:
        out["no_degree_sign"] = gold.replace("^{\\circ}", "").replace("^\\circ", "").strip()
    if "\\!" in gold or "{,}" in gold:
        out["no_thousands_sep"] = re.sub(r",\\!|\{,\}", "", gold)
    mixed_number = re.search(r"\d\s*\\[dt]?frac", gold)  # 1\frac{4}{5}: "14/5" would be another number
    if v is None and not mixed_number and (inline := re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}",
                                       lambda m: f"{_atom(m[1])}/{_atom(m[2])}", gold)) != gold:
        out["inline_slash"] = inline
    if v is not None and v.denominator == 1 and "." not in gold:
        out["trailing_period"] = f"{gold}."
    if re.search(r"\\frac\{\d\}\{\d\}", gold):
        out["frac_shorthand"] = re.sub(r"\\frac\{(\d)\}\{(\d)\}", r"\\frac\1\2", gold)
    if re.search(r"\\sqrt\{\d\}", gold):
        out["sqrt_shorthand"] = re.sub(r"\\sqrt\{(\d)\}", r"\\sqrt\1", gold)
    elif re.search(r"\\sqrt\d", gold):
        out["sqrt_braces"] = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", gold)
    if m := re.fullmatch(r"-\\frac\{([^{}]+)\}\{([^{}]+)\}", gold):
        out["minus_inside"] = f"\\frac{{-{m[1]}}}{{{m[2]}}}"
    if m := re.fullmatch(r"(\d+)\s*(\\sqrt\{?\d+\}?|\\pi)", gold):
        out["explicit_times"] = f"{m[1]} \\cdot {m[2]}"
    if m := re.fullmatch(r"\\text\{\s*\(?([^{}()]+?)\)?\s*\}", gold):
        out["text_unwrapped"] = m[1]
    if (s := _reordered_sum(gold)) is not None:
        out["reordered_sum"] = s
    if (s := _reordered_list(gold)) is not None:
        out["reordered_list"] = s
    return [(k, a) for k, a in out.items() if a.strip() and a != gold]


# -- wrong answers ---------------------------------------------------------------------------------------------


def _compact(answer: str) -> str:
    for old in ("\\left", "\\right", "\\dfrac", " ", "\\!"):
        answer = answer.replace(old, "\\frac" if old == "\\dfrac" else "")
    return answer


# digits that are not part of the value: a base subscript (52_8, 4210_{5}) or a unit's power (\mbox{ cm}^2)
_NOT_VALUE_DIGITS = re.compile(r"_\{?\d+\}?|\}\^\{?\d+\}?")


def _bump(gold: str, i: int) -> str:
    return gold[:i] + str((int(gold[i]) + 1) % 10) + gold[i + 1:]


def near_miss(gold: str) -> str | None:
    """The gold with the last digit of its value changed (a different value; for a list, a different last
    element)."""
    skip = {i for m in _NOT_VALUE_DIGITS.finditer(gold) for i in range(m.start(), m.end())}
    digits = [m.start() for m in re.finditer(r"\d", gold) if m.start() not in skip]
    return _bump(gold, digits[-1]) if digits else None


def other_base(gold: str) -> str | None:
    """A number in base b (52_8) with another base subscript: a different value."""
    m = re.search(r"_\{?(\d+)\}?$", gold)
    return _bump(gold, m.end(1) - 1) if m else None


def other_gold(golds: Sequence[Gold], index: int) -> str:
    """The gold of a later problem of the same set whose answer differs from this one's."""
    mine = golds[index]
    same_set = [g for g in golds if g.id.rsplit("-", 1)[0] == mine.id.rsplit("-", 1)[0]]
    pos = same_set.index(mine)
    for step in range(7, 7 + len(same_set)):
        other = same_set[(pos + step) % len(same_set)].answer
        if _compact(other) != _compact(mine.answer) and (_value(other) is None or _value(other) != _value(mine.answer)):
            return other
    raise ValueError(f"no different gold answer for {mine.id}")


# -- outputs ---------------------------------------------------------------------------------------------------

_THINK = "<think> Let me work this out step by step. ... </think>"


def output(answer: str) -> str:
    return f"{_THINK} <answer> The final answer is \\boxed{{{answer}}} </answer>"


def _format_variant(i: int, gold: str) -> tuple[str, str]:
    variants = (
        ("two_answer_tags", f"<think> I will put the result in <answer> tags. </think> <answer> \\boxed{{{gold}}} "
                            "</answer>"),
        ("text_after_box", f"{_THINK} <answer> \\boxed{{{gold}}}. That is the final answer. </answer>"),
        ("corrected_box", f"{_THINK} <answer> \\boxed{{{near_miss(gold) or '0'}}}, no wait: \\boxed{{{gold}}} "
                          "</answer>"),
        ("newlines", f"{_THINK}\n<answer>\n\\boxed{{{gold}}}\n</answer>"),
    )
    return variants[i % len(variants)]


def _malformed_variant(i: int, gold: str) -> tuple[str, str, str]:
    variants = (
        ("no_answer_block", f"{_THINK} The final answer is \\boxed{{{gold}}}.", "stop"),
        ("box_outside_block", f"{_THINK} <answer> see below </answer> \\boxed{{{gold}}}", "stop"),
        ("unclosed_box", f"{_THINK} <answer> \\boxed{{{gold} </answer>", "stop"),
        ("empty_box", f"{_THINK} <answer> \\boxed{{}} </answer>", "stop"),
        ("no_box_in_block", f"{_THINK} <answer> {gold} </answer>", "stop"),
        ("truncated", output(gold), "length"),
        ("truncated_in_box", f"{_THINK} <answer> \\boxed{{{gold[: max(1, len(gold) // 2)]}", "length"),
        ("no_closing_answer_tag", f"{_THINK} <answer> \\boxed{{{gold}}}", "stop"),
    )
    return variants[i % len(variants)]


def build_cases(golds: Sequence[Gold]) -> list[Case]:
    """Every kind of case for every gold answer (format and malformed variants rotate over the problems)."""
    cases = []
    for i, g in enumerate(golds):
        def add(kind: str, variant: str, answer: str, completion: str, finish: str = "stop",
                g: Gold = g) -> None:
            cases.append(Case(kind, variant, g.id, g.answer, answer, completion, finish, EXPECTED[kind]))

        add("gold", "gold", g.answer, output(g.answer))
        for variant, answer in rewrites(g.answer, g.problem):
            if i % SAMPLED_REWRITES.get(variant, 1) == 0:
                add("rewrite", variant, answer, output(answer))
        wrong = other_gold(golds, i)
        add("wrong", "other_gold", wrong, output(wrong))
        if (miss := near_miss(g.answer)) is not None:
            add("near_miss", "last_digit", miss, output(miss))
        if (miss := other_base(g.answer)) is not None:
            add("near_miss", "base_subscript", miss, output(miss))
        variant, completion = _format_variant(i, g.answer)
        add("format", variant, g.answer, completion)
        variant, completion, finish = _malformed_variant(i, g.answer)
        add("malformed", variant, g.answer, completion, finish)
    return cases


# -- scoring and report ----------------------------------------------------------------------------------------


def _items(cases: Sequence[Case]) -> list[dict]:
    return [{"problem": {"answer": c.gold}, "completion": c.completion, "finish_reason": c.finish_reason}
            for c in cases]


def score_with_pool(cases: Sequence[Case], workers: int = 2, timeout_s: float = 10.0
                    ) -> tuple[dict[str, list[RewardResult]], dict[str, float], dict[str, int]]:
    """Each rule over all cases in reward pool workers: (results per rule, seconds per rule, pool counters)."""
    results, seconds = {}, {}
    with RewardPool(workers=workers, timeout_s=timeout_s) as pool:
        for name, ref in RULES.items():
            pool.score(ref, _items(cases[: 4 * workers]))  # starts and warms the workers before the clock
            start = time.monotonic()
            results[name] = pool.score(ref, _items(cases))
            seconds[name] = time.monotonic() - start
        stats = pool.stats()
    return results, seconds, stats


def score_in_process(cases: Sequence[Case]) -> dict[str, list[RewardResult]]:
    """The same, in this process (tests): no pool, so only signal timeouts where they apply."""
    out = {}
    for name, ref in RULES.items():
        fn: Callable[[dict], RewardResult] = resolve(ref)
        getattr(fn, "warmup", lambda: None)()
        out[name] = [fn(item) for item in _items(cases)]
    return out


@dataclass
class KindCounts:
    cases: int = 0
    orz_exact_as_expected: int = 0
    math_verify_as_expected: int = 0
    disagreements: int = 0


def tally(cases: Sequence[Case], results: dict[str, list[RewardResult]]) -> dict[str, KindCounts]:
    counts = {k: KindCounts() for k in KINDS}
    for c, a, b in zip(cases, results["orz_exact"], results["math_verify"]):
        k = counts[c.kind]
        k.cases += 1
        k.orz_exact_as_expected += (a.reward == 1.0) == c.expected
        k.math_verify_as_expected += (b.reward == 1.0) == c.expected
        k.disagreements += (a.reward == 1.0) != (b.reward == 1.0)
    return counts


def _cell(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else ""


def _verdict(r: RewardResult) -> str:
    return ("1" if r.reward == 1.0 else "0") + (f" ({_cell(r.info, 70)})" if r.info else "")


def report(cases: Sequence[Case], results: dict[str, list[RewardResult]], seconds: dict[str, float],
           command: str, workers: int, stats: dict[str, int]) -> str:
    counts = tally(cases, results)
    total = KindCounts(sum(k.cases for k in counts.values()),
                       sum(k.orz_exact_as_expected for k in counts.values()),
                       sum(k.math_verify_as_expected for k in counts.values()),
                       sum(k.disagreements for k in counts.values()))
    by_variant = Counter((c.kind, c.variant) for c in cases)
    lines = [
        "# ORZ's own answer check (`orz_exact`) against the math-verify ORZ rule (`orz`)",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d')}: {total.cases} constructed ORZ-format outputs from "
        "the gold answers of MATH-500 and AIME 2024 (see `bench/reward_agreement.py` for how each kind is "
        "built). \"As expected\" counts the verdicts that match the one ORZ's rules intend for the case. "
        + " ".join(f"Rewrite `{v}` is built for every {n}th problem only (it disagrees on every integer answer)."
                   for v, n in SAMPLED_REWRITES.items()),
        "",
        f"Time: orz_exact {seconds.get('orz_exact', 0):.1f} s, math-verify {seconds.get('math_verify', 0):.1f} s "
        f"for all cases with {workers} reward pool workers (shared 2-core machine); pool counters {stats}.",
        "",
        "| kind | expected | cases | orz_exact as expected | math-verify as expected | disagreements |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind, k in counts.items():
        lines.append(f"| {kind} | {'accept' if EXPECTED[kind] else 'reject'} | {k.cases} | "
                     f"{k.orz_exact_as_expected} | {k.math_verify_as_expected} | {k.disagreements} |")
    lines += [f"| **all** | | {total.cases} | {total.orz_exact_as_expected} | {total.math_verify_as_expected} | "
              f"{total.disagreements} |", "", "Cases per variant: " + ", ".join(
                  f"{kind}/{variant} {n}" for (kind, variant), n in sorted(by_variant.items())) + ".", ""]
    rows = [(c, a, b) for c, a, b in zip(cases, results["orz_exact"], results["math_verify"])
            if (a.reward == 1.0) != (b.reward == 1.0)]
    rows.sort(key=lambda r: (KINDS.index(r[0].kind), r[0].variant))  # stable: problems stay in file order
    per_variant = Counter((c.kind, c.variant) for c, _, _ in rows)
    lines += ["## Disagreements by variant", "", "| kind / variant | cases | disagreements | why |",
              "|---|---:|---:|---|"]
    for (kind, variant), n in sorted(per_variant.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1])):
        lines.append(f"| {kind} / {variant} | {by_variant[kind, variant]} | {n} | {CAUSES.get(variant, '')} |")
    both_wrong = Counter((c.kind, c.variant) for c, a, b in zip(cases, results["orz_exact"], results["math_verify"])
                         if (a.reward == 1.0) == (b.reward == 1.0) != c.expected)
    if both_wrong:
        lines += ["", "Both rules miss the expected verdict on: " + ", ".join(
            f"{kind}/{variant} {n}" for (kind, variant), n in sorted(both_wrong.items())) + ". " + " ".join(
            CAUSES.get(variant, "") for _, variant in sorted(both_wrong))]
    lines += ["", f"## Every disagreement ({len(rows)})", "",
              "| kind / variant | problem | gold | answer | orz_exact | math-verify |", "|---|---|---|---|---|---|"]
    for c, a, b in rows:
        lines.append(f"| {c.kind} / {c.variant} | {c.problem_id} | {_cell(c.gold)} | {_cell(c.answer)} | "
                     f"{_verdict(a)} | {_verdict(b)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reward_agreement", description=__doc__.split("\n")[0])
    parser.add_argument("data_dir", nargs="?", default=str(DEFAULT_DATA_DIR),
                        help="folder with ORZ's math500.json and aime2024.json (default: %(default)s)")
    parser.add_argument("--out", default="orz_reward_agreement.md", help="markdown report (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="reward pool workers (default: %(default)s)")
    parser.add_argument("--cases-out", help="also write every case with both verdicts as JSON lines here")
    args = parser.parse_args(argv)

    golds = load_golds(args.data_dir)
    cases = build_cases(golds)
    print(f"{len(golds)} gold answers -> {len(cases)} cases: "
          + ", ".join(f"{k} {n}" for k, n in Counter(c.kind for c in cases).items()), flush=True)
    start = time.monotonic()
    results, seconds, stats = score_with_pool(cases, workers=args.workers)
    elapsed = time.monotonic() - start
    command = "python -m bench.reward_agreement " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(report(cases, results, seconds, command.strip(), args.workers, stats), encoding="utf-8")
    if args.cases_out:
        with open(args.cases_out, "w", encoding="utf-8") as f:
            for c, a, b in zip(cases, results["orz_exact"], results["math_verify"]):
                f.write(json.dumps({**asdict(c), "orz_exact": asdict(a), "math_verify": asdict(b)}) + "\n")
    print(f"{'kind':<10} {'cases':>6} {'orz_exact ok':>13} {'math-verify ok':>15} {'disagree':>9}")
    for kind, k in tally(cases, results).items():
        print(f"{kind:<10} {k.cases:>6} {k.orz_exact_as_expected:>13} {k.math_verify_as_expected:>15} "
              f"{k.disagreements:>9}")
    print(f"orz_exact {seconds['orz_exact']:.1f} s, math-verify {seconds['math_verify']:.1f} s, total {elapsed:.1f} s "
          f"with {args.workers} workers; pool {stats}; report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
