"""Long multiplication written out step by step: a task whose answers are long (about 130-155 tokens at 3 x 3).

The tiny recipes' answers are a few tokens, so per-step overhead rules their timings. This task makes a model of
realistic size write a real scratchpad, so generation and training cost what they cost at scale. It is harder to
learn than it looks: a 24M-parameter model had the format but not one product right after 200 warm-up steps (batch
16), so the benchmarks' heavier workload is `counting` (recipes/counting_cpu.yaml) instead.

Every number in the scratchpad is written least significant digit first, as the arithmetic task's `reverse` does:
a left-to-right model then carries as it goes, and each step reads only digits it has just written. For 417*386:

    417*386=                               <- the prompt ends here
    6*7=42 6*1+4=10 6*4+1=25 so 2052       <- 417*6 = 2502, reversed
    8*7=56 8*1+5=13 8*4+1=33 so 06333      <- 417*8*10 = 33360, reversed (one leading zero per place)
    3*7=21 3*1+2=5 3*4+0=12 so 001521
    2052+06333=26853                       <- the running sum, reversed
    26853+001521=269061
    answer 269061                          <- 160962, reversed; then the end token

Only the final line is scored: the integer after "answer " (reversed back) must equal a*b exactly. The held-out set
is drawn first from its own seeded stream and the training set excludes it, as in `arithmetic`.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.base import draw_distinct, stated_answer


def rev(n: int) -> str:
    """`n`'s digits, least significant first (0 -> "0")."""
    return str(n)[::-1]


def scratchpad(a: int, b: int) -> str:
    """The worked multiplication of `a` by `b` (both positive), ending with the answer line, no end token."""
    lines, partials = [], []
    for place, d in enumerate(int(c) for c in reversed(str(b))):
        steps, carry = [], 0
        for x in (int(c) for c in reversed(str(a))):
            value = d * x + carry
            steps.append(f"{d}*{x}={value}" if not steps else f"{d}*{x}+{carry}={value}")
            carry = value // 10
        partial = d * a * 10**place
        # leading zeros stand for the place; a zero partial keeps its place's zeros so the addition lines up
        written = "0" * place + rev(d * a)
        partials.append((partial, written))
        lines.append(" ".join(steps) + f" so {written}")
    total, total_written = partials[0]
    for partial, written in partials[1:]:
        new_total = total + partial
        lines.append(f"{total_written}+{written}={rev(new_total)}")
        total, total_written = new_total, rev(new_total)
    lines.append(f"answer {rev(a * b)}")
    return "\n".join(lines)


def parse_final_answer(completion: str) -> int | None:
    """The product the completion states on its last line ("answer 269061" -> 160962), or None."""
    digits = stated_answer(completion)
    return int(digits[::-1]) if digits is not None else None


def score_long_multiplication(item: dict) -> RewardResult:
    """Pool entry point: 1 for the exact product on the answer line of a finished completion, else 0."""
    problem, completion = item["problem"], item["completion"]
    if item.get("finish_reason", "stop") != "stop":
        return RewardResult(0.0, {"correct": 0.0, "truncated": 1.0})
    correct = float(parse_final_answer(completion) == problem["a"] * problem["b"])
    return RewardResult(correct, {"correct": correct})


@dataclass
class LongMultiplicationTask:
    """Products of a `digits_a`-digit and a `digits_b`-digit number, answered with a written-out scratchpad."""

    digits_a: int = 3
    digits_b: int = 3
    num_train: int = 20000
    num_eval: int = 200
    seed: int = 0
    name: str = "long_multiplication"
    reward_fn = staticmethod(score_long_multiplication)

    def __post_init__(self) -> None:
        if not (1 <= self.digits_a <= 6 and 1 <= self.digits_b <= 6):
            raise ValueError(f"digits_a and digits_b must be 1..6, got {self.digits_a} and {self.digits_b}")
        space = 9**self.digits_a * 9**self.digits_b
        if self.num_train + self.num_eval > space // 2:
            raise ValueError(f"num_train + num_eval = {self.num_train + self.num_eval} is more than half of the "
                             f"{space} possible problems; lower them or use more digits")

    def _operand(self, rng: random.Random, digits: int) -> int:
        # no zero digits: a zero row is a line of zeros, and every answer stays above 128 tokens at 3 x 3 digits
        return int("".join(str(rng.randint(1, 9)) for _ in range(digits)))

    def _draw(self, count: int, rng: random.Random, exclude: frozenset) -> list[tuple[int, int]]:
        return draw_distinct(count, rng, lambda r: (self._operand(r, self.digits_a), self._operand(r, self.digits_b)),
                             exclude)

    @functools.cached_property
    def _eval_keys(self) -> list[tuple[int, int]]:
        return self._draw(self.num_eval, random.Random(f"{self.seed}-longmul-eval"), frozenset())

    @functools.cached_property
    def _train_keys(self) -> list[tuple[int, int]]:
        return self._draw(self.num_train, random.Random(f"{self.seed}-longmul-train"), frozenset(self._eval_keys))

    def train_problems(self) -> list[dict]:
        return [{"id": f"longmul-train-{i}", "a": a, "b": b} for i, (a, b) in enumerate(self._train_keys)]

    def eval_problems(self) -> list[dict]:
        return [{"id": f"longmul-eval-{i}", "a": a, "b": b} for i, (a, b) in enumerate(self._eval_keys)]

    def prompt(self, problem: dict) -> str:
        return f"{problem['a']}*{problem['b']}=\n"

    def target(self, problem: dict, eos: str = "") -> str:
        return scratchpad(problem["a"], problem["b"]) + eos
