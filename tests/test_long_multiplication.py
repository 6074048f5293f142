"""Long multiplication with a written-out scratchpad (pipelinerl/tasks/long_multiplication.py): its worked answers
are right, long, and scored only on the stated product."""

from __future__ import annotations

import random

import pytest

from pipelinerl.tasks.long_multiplication import (
    LongMultiplicationTask,
    parse_final_answer,
    score_long_multiplication,
    scratchpad,
)


def score(a: int, b: int, completion: str, finish_reason: str = "stop") -> float:
    return score_long_multiplication({"problem": {"a": a, "b": b}, "completion": completion,
                                      "finish_reason": finish_reason}).reward


def test_every_line_of_the_scratchpad_is_true_arithmetic():
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randint(1, 99999), rng.randint(1, 99999)
        lines = scratchpad(a, b).splitlines()
        partials = []
        for place, (line, d) in enumerate(zip(lines, map(int, reversed(str(b))))):
            steps, written = line.split(" so ")
            for step in steps.split():  # "d*x=v" or "d*x+c=v"
                lhs, value = step.split("=")
                assert eval(lhs) == int(value), line  # noqa: S307 - our own digits and operators
            assert int(written[::-1]) == d * a * 10**place
            partials.append(int(written[::-1]))
        for line in lines[len(partials):-1]:  # running sums, reversed
            lhs, total = line.split("=")
            x, y = lhs.split("+")
            assert int(x[::-1]) + int(y[::-1]) == int(total[::-1]), line
        assert lines[-1] == f"answer {str(a * b)[::-1]}"
        assert parse_final_answer(scratchpad(a, b)) == a * b


def test_reward_reads_only_the_final_product():
    good = scratchpad(417, 386)
    assert score(417, 386, good) == 1.0
    assert score(417, 386, good + "\n") == 1.0
    assert score(417, 386, good, finish_reason="length") == 0.0  # truncated: never scored as right
    assert score(417, 386, good.replace("answer 269061", "answer 269062")) == 0.0
    assert score(417, 386, good.replace("answer 269061", "answer 160962")) == 0.0  # not reversed: wrong
    assert score(417, 386, "answer 269061") == 1.0  # the scratchpad is the model's business
    assert score(417, 386, good.rsplit("\n", 1)[0]) == 0.0  # no answer line
    assert score(417, 386, good + "\nanswer 1") == 0.0  # the last answer counts
    assert score(417, 386, "answer " + "9" * 5000) == 0.0


def test_answers_are_long_and_splits_disjoint():
    task = LongMultiplicationTask(num_train=3000, num_eval=100)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(train) == 3000 and len(held_out) == 100
    assert not {(p["a"], p["b"]) for p in train} & {(p["a"], p["b"]) for p in held_out}
    assert min(len(task.target(p)) for p in train + held_out) >= 128
    assert LongMultiplicationTask(num_train=10, num_eval=5).eval_problems() == held_out[:5]  # independent of num_train
    for p in held_out[:20]:
        assert score(p["a"], p["b"], task.target(p)) == 1.0
    with pytest.raises(ValueError, match="digits_a"):
        LongMultiplicationTask(digits_a=0)
    with pytest.raises(ValueError, match="num_train"):
        LongMultiplicationTask(digits_a=1, digits_b=1, num_train=100)
