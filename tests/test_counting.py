"""The heavier benchmark workload's task (pipelinerl/tasks/counting.py): its worked answers are right, long, and
scored only on the stated last number; the recipe loads and its task builds from the dotted path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.tasks import check_task
from pipelinerl.tasks.counting import CountingTask, count_lines, parse_final_answer, score_counting

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "counting_cpu.yaml"
LONG_RECIPE = RECIPE.with_name("counting_long_cpu.yaml")


def score(problem: dict, completion: str, finish_reason: str = "stop") -> float:
    return score_counting({"problem": problem, "completion": completion, "finish_reason": finish_reason}).reward


def test_every_line_is_true_arithmetic_modulo_the_digits():
    rng = random.Random(0)
    for _ in range(300):
        digits, lines = rng.randint(1, 5), rng.randint(1, 20)
        start, step = rng.randrange(10**digits), rng.randint(1, 9)
        worked = count_lines(start, step, digits, lines)
        assert len(worked) == lines + 1
        x = start
        for line in worked[:-1]:
            lhs, result = line.split("=")
            a, b = lhs.split("+")
            assert len(a) == len(result) == digits  # zero-padded, least significant digit first
            assert int(a[::-1]) == x and int(b) == step
            x = int(result[::-1])
            assert x == (int(a[::-1]) + step) % 10**digits
        assert worked[-1] == f"answer {str(x).zfill(digits)[::-1]}"
        assert x == (start + lines * step) % 10**digits


def test_reward_reads_only_the_final_number():
    problem = {"start": 137, "step": 8, "digits": 3, "lines": 12}
    good = CountingTask().target(problem)
    assert good.endswith("answer 332")  # 137 + 96 = 233, reversed
    assert parse_final_answer(good) == 233
    assert score(problem, good) == 1.0
    assert score(problem, good + "\n") == 1.0
    assert score(problem, good, finish_reason="length") == 0.0  # truncated: never scored as right
    assert score(problem, good.replace("answer 332", "answer 333")) == 0.0
    assert score(problem, good.replace("answer 332", "answer 233")) == 0.0  # not reversed: wrong
    assert score(problem, "answer 332") == 1.0  # the worked lines are the model's business
    assert score(problem, good.rsplit("\n", 1)[0]) == 0.0  # no answer line
    assert score(problem, good + "\nanswer 1") == 0.0  # the last answer counts
    assert score(problem, "answer " + "9" * 5000) == 0.0
    twelve = {"start": 0, "step": 1, "digits": 3, "lines": 12}  # ends at 12, written "210"
    assert score(twelve, "answer 210") == 1.0
    assert score(twelve, "answer 21") == score(twelve, "answer 2100") == 0.0  # the padding is part of the answer


def test_answers_are_long_and_splits_disjoint():
    task = CountingTask(num_train=3000, num_eval=100)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(train) == 3000 and len(held_out) == 100
    assert not {(p["start"], p["step"]) for p in train} & {(p["start"], p["step"]) for p in held_out}
    assert {len(task.target(p)) for p in train + held_out} == {130}
    assert CountingTask(num_train=10, num_eval=5).eval_problems() == held_out[:5]  # independent of num_train
    for p in held_out[:20]:
        assert score(p, task.target(p)) == 1.0
    with pytest.raises(ValueError, match="digits"):
        CountingTask(digits=0)
    with pytest.raises(ValueError, match="num_train"):
        CountingTask(digits=2, num_train=1000)


@pytest.mark.parametrize("recipe", [RECIPE, LONG_RECIPE], ids=["counting_cpu", "counting_long_cpu"])
def test_the_recipe_builds_its_task_and_fits_its_answers(recipe):
    cfg = load_config(recipe)
    task = check_task(cfg.task)
    assert isinstance(task, CountingTask)
    prompt_len = max(len(task.prompt(p)) for p in task.eval_problems())
    answer_len = max(len(task.target(p)) + 1 for p in task.eval_problems())  # +1: the end token
    assert cfg.sampling.max_new_tokens >= answer_len >= 128
    assert cfg.engine.max_model_len >= prompt_len + cfg.sampling.max_new_tokens
    with pytest.raises(ConfigError, match="task.args"):
        check_task(load_config(recipe, ["task.args.digits=9"]).task)


def test_long_tailed_answers_span_twenty_times_with_the_median_far_below_the_longest():
    """lines_max: each problem its own number of lines, log-uniform, stated in the prompt (the long-tail workload
    of recipes/counting_long_cpu.yaml); a problem's lines do not depend on how many problems are drawn."""
    task = CountingTask(lines=1, lines_max=48, num_train=4000, num_eval=100)
    train = task.train_problems()
    lengths = sorted(len(task.target(p)) for p in train)
    assert lengths[-1] >= 20 * lengths[0] and lengths[len(lengths) // 2] <= lengths[-1] / 4
    assert {p["lines"] for p in train} == set(range(1, 49))
    for p in train[:50]:
        assert task.prompt(p) == f"{str(p['start']).zfill(3)[::-1]} {p['step']} {p['lines']}\n"
        assert len(task.target(p).splitlines()) == p["lines"] + 1 and score(p, task.target(p)) == 1.0
    assert [p["lines"] for p in CountingTask(lines=1, lines_max=48, num_train=10).train_problems()] == [
        p["lines"] for p in train[:10]]
    assert CountingTask().prompt(train[0]).count(" ") == 1  # without lines_max the prompt is as it was
    with pytest.raises(ValueError, match="lines_max"):
        CountingTask(lines=12, lines_max=4)
