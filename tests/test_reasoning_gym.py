"""The reasoning_gym task (pipelinerl/tasks/reasoning_gym.py): Reasoning Gym's generators mixed by weight, held-out
problems disjoint from training, every problem naming its generator, scored in the reward workers by the library's
own `score_answer`; generators and settings that cannot work refused when the task is made, naming them."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("reasoning_gym", reason="the reasoning extra: pip install -e '.[reasoning]'")

from pipelinerl.config import ConfigError, load_config  # noqa: E402
from pipelinerl.rewards import RewardPool  # noqa: E402
from pipelinerl.tasks import reward_item, task_from_config  # noqa: E402
from pipelinerl.tasks.reasoning_gym import ReasoningGymTask, extract  # noqa: E402


def test_generators_mix_by_weight_with_held_out_problems_never_trained_on():
    task = ReasoningGymTask({"leg_counting": 3, "basic_arithmetic": 1}, num_train=400, num_eval=40, seed=3)
    train, held_out = task.train_problems(), task.eval_problems()
    assert Counter(p["domain"] for p in train) == {"leg_counting": 300, "basic_arithmetic": 100}
    assert Counter(p["domain"] for p in held_out) == {"leg_counting": 30, "basic_arithmetic": 10}
    assert not {p["problem"] for p in train} & {p["problem"] for p in held_out}
    assert len({p["id"] for p in train + held_out}) == 440
    again = ReasoningGymTask({"leg_counting": 3, "basic_arithmetic": 1}, num_train=400, num_eval=40, seed=3)
    assert again.eval_problems() == held_out and again.train_problems() == train  # the seed decides them
    other = ReasoningGymTask({"leg_counting": 3, "basic_arithmetic": 1}, num_train=10, num_eval=40, seed=3)
    assert other.eval_problems() == held_out  # the held-out set does not depend on num_train
    assert task.prompt(held_out[0]).endswith("\nAnswer:")


def test_the_library_scores_answers_in_the_reward_workers():
    task = ReasoningGymTask(["leg_counting", "basic_arithmetic"], num_train=4, num_eval=6, seed=0)
    problems = task.eval_problems()
    items = [reward_item(p, f" {p['answer']}\nmore text", "stop") for p in problems]
    items += [reward_item(p, " 123456789", "stop") for p in problems]
    items += [reward_item(problems[0], "   \n", "length")]
    with RewardPool(1, 10.0) as pool:
        results = pool.score(task.reward_fn, items)
    n = len(problems)
    assert [r.reward for r in results[:n]] == [1.0] * n and all(r.parts["correct"] == 1.0 for r in results[:n])
    assert all(r.parts["correct"] == 0.0 for r in results[n:])
    assert results[-1].info == "no answer found"


def test_the_tag_format_takes_the_last_answer_block():
    assert extract("think... <answer>3</answer> no, <answer>4</answer>", "tag") == "4"
    assert extract("no tags here", "tag") is None
    assert extract("  42 \n because", "line") == "42"


def test_generators_and_settings_that_cannot_work_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'leg_countin' is not a Reasoning Gym generator"):
        ReasoningGymTask({"leg_countin": 1})
    with pytest.raises(ValueError, match="'composite' cannot be used here"):
        ReasoningGymTask(["composite"])
    with pytest.raises(ValueError, match="leg_counting with settings .* cannot make problems here: TypeError"):
        ReasoningGymTask(["leg_counting"], configs={"leg_counting": {"bogus": 3}})
    with pytest.raises(ValueError, match="configs for \\['basic_arithmetic'\\]"):
        ReasoningGymTask(["leg_counting"], configs={"basic_arithmetic": {}})
    with pytest.raises(ValueError, match="weight must be a number > 0"):
        ReasoningGymTask({"leg_counting": 0})
    # from a recipe: the key to change is named
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\ntask:\n  name: reasoning_gym\n"
                      "  args: {datasets: {leg_counting: 1}, num_train: 8, num_eval: 2}\n")
    task = task_from_config(load_config(recipe).task)
    assert len(task.train_problems()) == 8 and task.eval_problems()[0]["domain"] == "leg_counting"
    with pytest.raises(ConfigError, match="task.args: reasoning_gym refused its arguments: datasets: 'nope'"):
        task_from_config(load_config(recipe, ["task.args.datasets={nope: 1}"]).task)
