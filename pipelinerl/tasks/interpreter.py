"""Multiplication with a Python interpreter as a tool: the example of a multi-turn task in one file.

A problem is "347*58=". Without the tool (`tool: false`) the model must write the product itself, which a tiny
model mostly cannot. With it, the model may write a fenced python block; the actor pauses generation at the
closing fence, runs the block in the sandbox and appends its output, and the model goes on from there:

    347*58=```python            <- the model
    print(347*58)
    ```
    ```output                   <- the interpreter (context, never trained on)
    20126
    ```
    20126<eos>                  <- the model: the answer

The answer is the integer at the start of the text after the last tool output (the whole text without one).
To write a task of your own like this, copy this file: `rollout` is the only multi-turn part, and
`pipelinerl.tasks.workflow.python_tool_rollout` is the loop it runs (write your own loop for another environment).
Name it in a recipe as `task.name: pipelinerl.tasks.interpreter:InterpreterTask` with `task.args`.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.arithmetic import parse_answer
from pipelinerl.tasks.workflow import Episode, InterpreterSyntax, RolloutEngine, python_tool_rollout

SYNTAX = InterpreterSyntax()


def final_answer_text(completion: str, syntax: InterpreterSyntax = SYNTAX) -> str:
    """The text after the last tool output, where the model gives its answer."""
    head = syntax.observation.split("{output}")[0]
    start = completion.rfind(head)
    if start < 0:
        return completion
    tail = syntax.observation.split("{output}")[1]
    end = completion.find(tail, start + len(head))
    return completion[end + len(tail):] if end >= 0 else ""


def score_interpreter(item: dict) -> RewardResult:
    """Pool entry point: 1 when the model's last turn, after the last tool output, starts with the product. Only
    the model's own text counts: a tool output that prints a closing fence and the number is no answer."""
    expected = int(item["problem"]["answer"])
    got = parse_answer(item.get("final_turn", final_answer_text(item["completion"])))
    info = {"tool_calls": float(item.get("tool_calls", 0))}
    if got is None:
        return RewardResult(0.0, {"correct": 0.0, **info}, "no integer answer after the last tool output")
    if got != expected:
        return RewardResult(0.0, {"correct": 0.0, **info}, f"wrong answer: {got}, expected {expected}")
    return RewardResult(1.0, {"correct": 1.0, **info}, "")


@dataclass
class InterpreterTask:
    """Products of a `digits`-digit and a `digits2`-digit number; `tool` lets the model run Python."""

    digits: int = 3
    digits2: int = 2
    num_train: int = 5000
    num_eval: int = 200
    seed: int = 0
    tool: bool = True
    max_turns: int = 3
    tool_wall_s: float = 5.0
    name: str = "interpreter"
    reward_fn = staticmethod(score_interpreter)

    def __post_init__(self) -> None:
        if self.digits < 1 or self.digits2 < 1:
            raise ValueError("digits and digits2 must be at least 1")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        if self.num_train < 1 or self.num_eval < 0:
            raise ValueError("num_train must be at least 1 and num_eval at least 0")

    @functools.cached_property
    def _problems(self) -> tuple[list[dict], list[dict]]:
        rng = random.Random(f"interpreter-{self.seed}")
        seen: set[tuple[int, int]] = set()
        problems = []
        while len(problems) < self.num_eval + self.num_train:
            a = rng.randint(10 ** (self.digits - 1), 10 ** self.digits - 1)
            b = rng.randint(10 ** (self.digits2 - 1), 10 ** self.digits2 - 1)
            if (a, b) in seen:
                if len(seen) >= 9 * 10 ** (self.digits - 1) * 9 * 10 ** (self.digits2 - 1):
                    raise ValueError("num_train + num_eval exceed the distinct problems of these digits")
                continue
            seen.add((a, b))
            split, i = ("eval", len(problems)) if len(problems) < self.num_eval else \
                ("train", len(problems) - self.num_eval)
            problems.append({"id": f"mul-{split}-{i}", "a": a, "b": b, "answer": str(a * b)})
        return problems[self.num_eval:], problems[:self.num_eval]

    def train_problems(self) -> list[dict]:
        return self._problems[0]

    def eval_problems(self) -> list[dict]:
        return self._problems[1]

    def prompt(self, problem: dict) -> str:
        return f"{problem['a']}*{problem['b']}="

    def target(self, problem: dict, eos: str = "") -> str:
        """The supervised warm-up's answer: with the tool, the call, its output and the answer copied from it."""
        if not self.tool:
            return f"{problem['answer']}{eos}"
        call = f"{SYNTAX.call_start}print({problem['a']}*{problem['b']})\n{SYNTAX.call_end}"
        return f"{call}{SYNTAX.observation.format(output=problem['answer'] + chr(10))}{problem['answer']}{eos}"

    async def rollout(self, engine: RolloutEngine, problem: dict) -> Episode:
        from pipelinerl.sandbox import SandboxLimits

        turns = self.max_turns if self.tool else 1
        return await python_tool_rollout(engine, self.prompt(problem), max_turns=turns, syntax=SYNTAX,
                                         limits=SandboxLimits(wall_s=self.tool_wall_s))
