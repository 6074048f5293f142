"""Instruction following, scored by IFEval's own checkers: the instruction registry `lm-eval` ships
(`pip install -e ".[ifeval]"`, PyPI `lm-eval[ifeval]`), its strict and loose tests unchanged.

A problem holds IFEval's fields: `prompt`, `instruction_id_list` and `kwargs` (one dict per instruction). The
reward is 1 when every instruction is followed under the strict test (`reward: all`, IFEval's prompt-level
accuracy), or the fraction followed (`reward: fraction`, the instruction level). Every result carries the four
numbers IFEval reports, so the held-out evaluation gives them as IFEval does: prompt-level strict and loose
(`prompt_strict`, `prompt_loose`: all followed) and instruction-level strict and loose (`followed_strict`,
`followed_loose`, pooled over `instructions`).

Two checkers need NLTK's `punkt_tab` sentence model, which NLTK downloads on first use and which an offline
machine does not have: `length_constraints:number_sentences` and `change_case:capital_word_frequency`
(`unavailable_instructions()` finds out, on this machine, by running every checker once). Scoring one of them
without the model is an error the reward pool counts, never a 0; the task refuses such prompts when it is made
unless told to leave them out.
"""

from __future__ import annotations

import contextlib
import io
import random
from functools import cache

from pipelinerl.rewards.result import RewardResult

REWARDS = ("all", "fraction")
# what the held-out evaluation reports for a task scored here, IFEval's names -> (numerator part, denominator part
# or None for one per sample): prompt level is a mean over prompts, instruction level is pooled over instructions
EVAL_RATIOS = {
    "prompt_level_strict_acc": ("prompt_strict", None),
    "prompt_level_loose_acc": ("prompt_loose", None),
    "inst_level_strict_acc": ("followed_strict", "instructions"),
    "inst_level_loose_acc": ("followed_loose", "instructions"),
}
NLTK_HINT = ("it needs NLTK's punkt_tab sentence model, which this machine does not have: on a machine with "
             "network run `python -m nltk.downloader punkt_tab` (or copy an nltk_data folder here and set NLTK_DATA)")


@cache
def _library():
    """lm-eval's IFEval modules. Importing them tries to download punkt_tab (and prints the failure offline): that
    noise is kept out of the run's logs; what it means is found out by `unavailable_instructions`."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from lm_eval.tasks.ifeval import instructions_registry, utils
    except ImportError:
        raise ImportError("the ifeval task needs IFEval's checkers from lm-eval: pip install -e '.[ifeval]' "
                          "(PyPI lm-eval[ifeval])") from None
    return instructions_registry, utils


def registry() -> dict:
    """IFEval's instruction id -> checker class."""
    return _library()[0].INSTRUCTION_DICT


def conflicts() -> dict[str, set[str]]:
    """IFEval's instruction id -> the ids that cannot be asked with it (itself included)."""
    return _library()[0].INSTRUCTION_CONFLICTS


@cache
def unavailable_instructions() -> dict[str, str]:
    """Instruction id -> why its checker cannot run on this machine (data it needs and does not find)."""
    out = {}
    for instruction_id, cls in registry().items():
        checker = cls(instruction_id)
        state = random.getstate()
        try:
            random.seed(0)  # a checker with no arguments draws them from `random`: keep that from the caller
            checker.build_description(**({"prompt_to_repeat": "x"} if "repeat_prompt" in instruction_id else {}))
            checker.check_following("A first sentence. A second sentence.")
        except LookupError:
            out[instruction_id] = NLTK_HINT
        finally:
            random.setstate(state)
    return out


def _example(problem: dict):
    utils = _library()[1]
    return utils.InputExample(key=problem.get("key", 0), instruction_id_list=list(problem["instruction_id_list"]),
                              prompt=problem["prompt"], kwargs=[dict(k or {}) for k in problem["kwargs"]])


def follows(problem: dict, response: str) -> tuple[list[bool], list[bool]]:
    """IFEval's strict and loose verdicts, one per instruction of `problem`. Raises RuntimeError naming the
    instruction whose checker cannot run here."""
    utils = _library()[1]
    example = _example(problem)
    try:
        strict = utils.test_instruction_following_strict(example, response).follow_instruction_list
        loose = utils.test_instruction_following_loose(example, response).follow_instruction_list
    except LookupError:
        missing = [i for i in example.instruction_id_list if i in unavailable_instructions()]
        raise RuntimeError(f"cannot check {', '.join(missing) or 'an instruction'}: {NLTK_HINT}") from None
    return strict, loose


def ifeval_reward(problem: dict, completion: str, reward: str = "all") -> RewardResult:
    """1 when every instruction is followed (strict), or the fraction followed (`reward="fraction"`)."""
    strict, loose = follows(problem, completion)
    n = len(strict)
    parts = {"correct": float(all(strict)), "prompt_strict": float(all(strict)), "prompt_loose": float(all(loose)),
             "followed_strict": float(sum(strict)), "followed_loose": float(sum(loose)), "instructions": float(n)}
    missed = [i for i, ok in zip(problem["instruction_id_list"], strict) if not ok]
    value = parts["correct"] if reward == "all" else sum(strict) / max(1, n)
    return RewardResult(value, parts, ("not followed: " + ", ".join(missed)) if missed else "")


def score_ifeval(item: dict) -> RewardResult:
    """The reward workers' entry point: item = {"problem", "completion", "finish_reason"}; the problem's
    `reward` ("all" or "fraction") says how the verdicts become the reward."""
    problem = item["problem"]
    return ifeval_reward(problem, item["completion"], problem.get("reward", "all"))


def _warmup() -> None:
    """lm-eval's import (5-6 s: it loads its task manager) and the probe of the checkers, in each reward worker
    before its clock starts (`pool._worker_main`)."""
    unavailable_instructions()


score_ifeval.warmup = _warmup  # type: ignore[attr-defined]
