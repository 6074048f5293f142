"""Multiple-choice answers (GPQA Diamond): the option letter in the final \\boxed{} against the gold letter.

A problem is multiple choice when it has `choices` (letter -> option text) and its gold `answer` is one of those
letters (`is_choice_problem`). The answer is taken as ORZ takes any answer (`orz_exact.orz_extract`: the output must
have stopped, and the answer is the last \\boxed{} of the closed <answer> block), unless the problem's `reward_rule`
is "math" (the "boxed" and "plain" templates): then it is the last \\boxed{} anywhere and truncation does not gate.

What counts as choosing option C (letters are the choice keys, upper case as the prompt prints them):
- the letter alone, however wrapped: `C`, `(C)`, `[C]`, `\\text{C}`, `\\textbf{(C)}`, `$C$`, `C.`, "Option C";
- the letter followed by its text: `C) 5 m/s`, `(C) 5 m/s`, `C. 5 m/s`, `C: 5 m/s` (the letter decides, not the text);
- the option's text itself, compared without case, spaces, `$` and `\\text{}` wrappers, when exactly one option has
  that text. ORZ's own check (`is_equal` against the letter) counted only the letter forms; text answers are rare,
  and those that match say "chosen by the option text" in `info`, so letter-only accuracy stays recoverable.
A lower-case letter is not a letter answer (an option's text can be "d", as in GPQA's own data); it can still match
an option's text.
"""

from __future__ import annotations

import re

from pipelinerl.rewards.math import accepts_unclosed, close_answer_block, judged, last_boxed
from pipelinerl.rewards.orz_exact import orz_extract
from pipelinerl.rewards.result import RewardResult

# One LaTeX wrapper around the whole answer, removed repeatedly: \text{C}, \textbf{(C)}, \mathrm{ C }.
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|texttt|textrm|mathrm|mathbf|mathit|mathtt|operatorname|boxed)"
                      r"\s*\{(.*)\}", re.S)
_LETTER_ALONE = re.compile(r"(?:(?:option|choice|answer)\s*:?\s*)?[(\[]?\s*([A-Z])\s*[)\]]?", re.I)
_LETTER_THEN_TEXT = re.compile(r"[(\[]?([A-Z])\s*(?:[)\]:.]|\s-\s)\s*\S.*", re.S)


def is_choice_problem(problem: dict) -> bool:
    """Whether `problem` is multiple choice: a non-empty `choices` dict whose keys include the gold `answer`."""
    choices = problem.get("choices")
    return isinstance(choices, dict) and bool(choices) and str(problem.get("answer", "")).strip() in choices


def _unwrap(text: str) -> str:
    text = text.strip()
    while True:
        inner = text.replace("\\left", "").replace("\\right", "").strip().strip("$").strip()
        if (m := _WRAPPER.fullmatch(inner)) is not None:
            inner = m[1].strip()
        inner = inner.rstrip(".").strip()
        if inner == text:
            return text
        text = inner


def _text_key(text: str) -> str:
    """An option text or answer reduced for comparison: wrappers, `$`, case and whitespace do not count."""
    return " ".join(_unwrap(text).replace("$", "").split()).casefold()


def chosen_option(answer: str, choices: dict[str, str]) -> tuple[str | None, str]:
    """The option letter `answer` picks: (letter, "letter" | "text"), or (None, why none)."""
    plain = _unwrap(answer)
    if not plain:
        return None, "empty \\boxed{} answer"
    m = _LETTER_ALONE.fullmatch(plain)
    if m is not None and m[1].isupper():
        letter = m[1]
    elif (m := _LETTER_THEN_TEXT.fullmatch(plain)) is not None:
        letter = m[1]
    else:
        key = _text_key(plain)
        by_text = [k for k, v in choices.items() if _text_key(str(v)) == key]
        if len(by_text) == 1:
            return by_text[0], "text"
        if by_text:
            return None, f"the text {plain!r} is that of several options: {', '.join(by_text)}"
        return None, f"no option letter or option text in {plain[:80]!r}"
    if letter not in choices:
        return None, f"{letter} is not an option ({', '.join(choices)})"
    return letter, "letter"


def choice_reward(problem: dict, completion: str, finish_reason: str, orz_rule: bool = True,
                  accept_unclosed_answer: bool = False) -> RewardResult:
    """1 when the answer picks the gold option letter `problem["answer"]` among `problem["choices"]`.

    `orz_rule`: ORZ's extraction and its finish_reason gate (see the module docstring); False: the last \\boxed{}
    anywhere, whatever the finish_reason, like `math.math_reward`. `accept_unclosed_answer` (ORZ rule only): an
    unclosed last <answer> block is read as closed at the end of the output (`math.close_answer_block`).
    """
    choices = {str(k): str(v) for k, v in problem["choices"].items()}
    gold = str(problem["answer"]).strip()
    if orz_rule:
        if finish_reason != "stop":
            return judged(False, f"did not stop: finish_reason {finish_reason!r}")
        answer, why = orz_extract(close_answer_block(completion) if accept_unclosed_answer else completion)
        if answer is None:
            return judged(False, why)
    else:
        answer = last_boxed(completion)
        if answer is None:
            return judged(False, "no \\boxed{} answer")
    letter, how = chosen_option(answer, choices)
    if letter is None:
        return judged(False, how)
    if letter != gold:
        return judged(False, f"wrong option: {letter}, expected {gold}")
    return judged(True, "chosen by the option text" if how == "text" else "")


def score_choice(item: dict) -> RewardResult:
    """Pool entry point: item = {"problem", "completion", "finish_reason"}; ORZ's rule unless the problem's
    `reward_rule` is "math", and its `accept_unclosed_answer` (`math.UNCLOSED_KEY`) switches on that option."""
    problem = item["problem"]
    return choice_reward(problem, item["completion"], item["finish_reason"],
                         orz_rule=problem.get("reward_rule") != "math",
                         accept_unclosed_answer=accepts_unclosed(problem))


# A stated choice in free text, the last one counting: "Answer: B", "answer is (B)", "the correct option is B."
# A lower-case letter counts only after a colon ("answer: b"): "the answer is a bit tricky" names no option.
_STATED = re.compile(r"(?i:answer|option|choice)\s*(?:(?i:is)\s*(?:(?i:option)\s*)?[(\[]?\s*([A-Z])"
                     r"|[:=]\s*[(\[]?\s*([A-Za-z]))\s*[)\]]?(?![A-Za-z])")


def extract_choice(completion: str, choices: dict[str, str]) -> tuple[str | None, str]:
    """The option letter a free-text answer picks, in the usual forms: the last \\boxed{} (read as
    `chosen_option` reads it); else the last stated answer ("Answer: B", "The answer is (B)", "answer: b" too);
    else the whole reply as a letter alone or a letter with its text ("(B)", "B.", "B) 5 m/s"). Returns
    (letter, how) or (None, why none)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return chosen_option(boxed, choices)
    stated = [(m[1] or m[2]).upper() for m in _STATED.finditer(completion)]
    if stated:
        letter = stated[-1]
        return (letter, "letter") if letter in choices else (None, f"{letter} is not an option ({', '.join(choices)})")
    text = completion.strip()
    if text:
        letter, how = chosen_option(text.split("\n", 1)[0], choices)
        if letter is not None:
            return letter, how
    return None, "no option letter found (expected e.g. 'Answer: B', '(B)' or \\boxed{B})"


def score_multiple_choice(item: dict) -> RewardResult:
    """Pool entry point for the multiple_choice task: 1 when the reply picks the gold letter, in any usual form."""
    problem = item["problem"]
    choices = {str(k): str(v) for k, v in problem["choices"].items()}
    letter, how = extract_choice(item["completion"], choices)
    if letter is None:
        return judged(False, how)
    if letter != problem["answer"]:
        return judged(False, f"wrong option: {letter}, expected {problem['answer']}")
    return judged(True, "chosen by the option text" if how == "text" else "")
