"""Counting on from a number in steps of a digit, written out line by line: long answers whose format a mid-sized
model learns within minutes.

The heavier benchmark workload (bench/vs_trl.py, bench/pipeline_heavy.py, recipes/counting_cpu.yaml) needs answers
of at least 128 tokens from a model of at least 20M parameters, warmed up on 2 cores to a low but real success rate
that RL then raises. Long multiplication (`long_multiplication`) has the length, but a 24M model had not one product
right after 200 warm-up steps (batch 16), and sums of two 3-digit numbers (a Fibonacci sequence) gave 2% of the
held-out problems after 300; adding one digit with its carry, line after line, the same model's loss is 0.06 after
400 steps (recipes/counting_cpu.yaml: 3.5% of the held-out answers right at temperature 1, every line must be).

Every number is written least significant digit first and zero-padded to `digits` (a left-to-right model then
carries as it goes), and the sum is kept modulo 10**digits. From 137 in steps of 8, at 3 digits:

    731 8              <- the prompt: the start (137, reversed) and the step
    731+8=541          <- 137 + 8 = 145, reversed
    541+8=351          <- 153
    ...                (`lines` addition lines, then the answer line)
    answer 332         <- the last number (137 + 12 * 8 = 233), reversed; then the end token

At 3 digits and 12 lines every answer is exactly 130 characters (one token each with the tiny models' tokenizer).
Only the final line is scored: the digits after "answer " must be the last number as written (reversed and
zero-padded: "answer 21" for 12 at 3 digits is wrong, "answer 210" right); a wrong line on the way makes it
wrong. The held-out set is drawn first from its own seeded stream and the training set excludes it, as in
`arithmetic`.

With `lines_max`, the answers' lengths are long-tailed as reasoning traces are (issue 51: a synchronous step waits
for its longest answer): each problem counts for its own number of lines, drawn log-uniformly from `lines` to
`lines_max` (1 to 48 at 3 digits: answers of 20 to 490 characters, the median 70, the mean 127), and the prompt
says how many after the step ("731 8 12"). Without it the prompt and the answers stay as above.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.base import draw_distinct, stated_answer


def written(n: int, digits: int) -> str:
    """`n` zero-padded to `digits`, least significant digit first (45, 3 -> "540")."""
    return str(n).zfill(digits)[::-1]


def count_lines(start: int, step: int, digits: int, lines: int) -> list[str]:
    """The worked answer: `lines` addition lines and the answer line, no end token."""
    out, x = [], start
    for _ in range(lines):
        y = (x + step) % 10**digits
        out.append(f"{written(x, digits)}+{step}={written(y, digits)}")
        x = y
    out.append(f"answer {written(x, digits)}")
    return out


def last_number(problem: dict) -> int:
    return (problem["start"] + problem["lines"] * problem["step"]) % 10 ** problem["digits"]


def parse_final_answer(completion: str) -> int | None:
    """The number the completion states on its last line ("answer 332" -> 233), or None."""
    digits = stated_answer(completion)
    return int(digits[::-1]) if digits is not None else None


def score_counting(item: dict) -> RewardResult:
    """Pool entry point: 1 for the exact last number on the answer line of a finished completion, else 0."""
    problem, completion = item["problem"], item["completion"]
    if item.get("finish_reason", "stop") != "stop":
        return RewardResult(0.0, {"correct": 0.0, "truncated": 1.0})
    correct = float(stated_answer(completion) == written(last_number(problem), problem["digits"]))
    return RewardResult(correct, {"correct": correct})


@dataclass
class CountingTask:
    """Count on from a random `digits`-digit start in steps of a random digit 1-9, for `lines` lines (with
    `lines_max`: a number of lines per problem, log-uniform from `lines` to `lines_max`, stated in the prompt)."""

    digits: int = 3
    lines: int = 12
    lines_max: int | None = None
    num_train: int = 4000
    num_eval: int = 200
    seed: int = 0
    name: str = "counting"
    reward_fn = staticmethod(score_counting)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 8:
            raise ValueError(f"digits must be 1..8, got {self.digits}")
        if not 1 <= self.lines <= 64:
            raise ValueError(f"lines must be 1..64, got {self.lines}")
        if self.lines_max is not None and not self.lines <= self.lines_max <= 256:
            raise ValueError(f"lines_max must be in lines..256 (lines={self.lines}) or null, got {self.lines_max}")
        space = 9 * 10**self.digits
        if self.num_train + self.num_eval > space // 2:
            raise ValueError(f"num_train + num_eval = {self.num_train + self.num_eval} is more than half of the "
                             f"{space} possible problems; lower them or use more digits")

    def _draw(self, count: int, rng: random.Random, exclude: frozenset) -> list[tuple[int, int]]:
        return draw_distinct(count, rng, lambda r: (r.randrange(10**self.digits), r.randint(1, 9)), exclude)

    @functools.cached_property
    def _eval_keys(self) -> list[tuple[int, int]]:
        return self._draw(self.num_eval, random.Random(f"{self.seed}-counting-eval"), frozenset())

    @functools.cached_property
    def _train_keys(self) -> list[tuple[int, int]]:
        return self._draw(self.num_train, random.Random(f"{self.seed}-counting-train"), frozenset(self._eval_keys))

    def _lines(self, split: str, i: int) -> int:
        if self.lines_max is None:
            return self.lines
        rng = random.Random(f"{self.seed}-counting-{split}-{i}-lines")  # a problem's own, whatever else is drawn
        drawn = int(math.exp(rng.uniform(math.log(self.lines), math.log(self.lines_max + 1))))
        return min(self.lines_max, max(self.lines, drawn))  # (exp(log(n)) can round to just below n)

    def _problem(self, split: str, i: int, key: tuple[int, int]) -> dict:
        return {"id": f"counting-{split}-{i}", "start": key[0], "step": key[1], "digits": self.digits,
                "lines": self._lines(split, i)}

    def train_problems(self) -> list[dict]:
        return [self._problem("train", i, key) for i, key in enumerate(self._train_keys)]

    def eval_problems(self) -> list[dict]:
        return [self._problem("eval", i, key) for i, key in enumerate(self._eval_keys)]

    def prompt(self, problem: dict) -> str:
        lines = f" {problem['lines']}" if self.lines_max is not None else ""
        return f"{written(problem['start'], problem['digits'])} {problem['step']}{lines}\n"

    def target(self, problem: dict, eos: str = "") -> str:
        return "\n".join(count_lines(problem["start"], problem["step"], problem["digits"], problem["lines"])) + eos
