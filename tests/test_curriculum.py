"""A curriculum over a task's domains (`actor.curriculum`, pipelinerl/tasks/curriculum.py): the domain of each group
the actor starts follows the domains' pass rates among the answers it generated; off by default."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pipelinerl.actor import Actor
from pipelinerl.config import ConfigError, load_config
from pipelinerl.rewards import RewardResult
from pipelinerl.tasks.curriculum import DomainCurriculum

PROBLEMS = [{"domain": "a"}] * 30 + [{"domain": "b"}] * 10  # 30 of a, 10 of b


def draws(curriculum: DomainCurriculum, n: int, retired=()) -> Counter:
    return Counter(PROBLEMS[curriculum.take(retired)]["domain"] for _ in range(n))


def test_shares_start_at_the_weights_and_follow_the_pass_rates():
    c = DomainCurriculum(PROBLEMS, {"a": 3.0, "b": 1.0}, "learnability", floor=0.1, smoothing=0.5)
    assert c.weights() == {"a": 0.75, "b": 0.25}  # every domain starts at p = 0.5: its task weight
    for _ in range(20):
        c.observe("a", 8, 8)  # solved: no signal left in its groups
        c.observe("b", 4, 8)  # right half the time: the most
    assert c.pass_rate["a"] == pytest.approx(1.0, abs=1e-5) and c.pass_rate["b"] == pytest.approx(0.5)
    # a at its floor (3 x 0.1), b at its weight (1 x 1)
    assert c.weights()["b"] == pytest.approx(1 / 1.3, rel=1e-3)
    assert draws(c, 400)["b"] > 260  # 77% expected, against 25% at the weights
    unsolved = DomainCurriculum(PROBLEMS, {"a": 1.0, "b": 1.0}, "unsolved", floor=0.2, smoothing=1.0)
    unsolved.observe("a", 2, 8)  # p = 0.25: factor 0.75
    unsolved.observe("b", 8, 8)  # solved: factor 0, floored at 0.2
    assert unsolved.weights()["a"] == pytest.approx(0.75 / 0.95)


def test_problems_come_once_per_pass_and_retired_ones_never():
    c = DomainCurriculum(PROBLEMS, {"a": 1.0, "b": 1.0}, "learnability", seed=3)
    taken = [c.take() for _ in range(80)]
    b = [i for i in taken if PROBLEMS[i]["domain"] == "b"]
    assert sorted(b[:10]) == list(range(30, 40))  # every b problem once before any twice
    retired = set(range(30, 40))  # all of b solved and retired: b weighs 0
    assert c.weights(retired)["b"] == 0 and draws(c, 50, retired) == {"a": 50}
    assert c.take(set(range(40))) is None  # nothing left: the run is over


def test_a_restarted_curriculum_goes_on_where_it_stopped():
    first = DomainCurriculum(PROBLEMS, {"a": 1.0, "b": 2.0}, "unsolved", seed=1)
    for _ in range(7):
        first.take()
    first.observe("b", 1, 4)
    again = DomainCurriculum(PROBLEMS, {"a": 1.0, "b": 2.0}, "unsolved", seed=1, state=json.loads(
        json.dumps(first.state())))
    assert [again.take() for _ in range(30)] == [first.take() for _ in range(30)]


def mix_config(tmp_path, tiny_model_dir, *extra: str):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {{path: {tiny_model_dir}}}\n"
        "task:\n  name: mix\n  args:\n    domains:\n"
        "      easy: {task: arithmetic, args: {digits: 1, num_train: 40, num_eval: 4}}\n"
        "      hard: {task: arithmetic, args: {digits: 3, num_train: 40, num_eval: 4}}\n"
        "sampling: {group_size: 4}\ntrainer: {samples_per_step: 4}\nactor: {dynamic_sampling: false}\n")
    return load_config(recipe, list(extra))


def test_the_actor_draws_the_domains_its_policy_can_learn_from(tmp_path, tiny_model_dir):
    """Through the actor's own problem taking and group streaming: a domain the policy always solves fades to its
    floor, and the shares and pass rates are in actor_metrics.jsonl; a restarted actor keeps what it measured."""
    cfg = mix_config(tmp_path, tiny_model_dir, "actor.curriculum=learnability", "actor.curriculum_smoothing=0.2")
    actor = Actor(cfg, [])
    right, wrong = RewardResult(1.0, {"correct": 1.0}), RewardResult(0.0, {"correct": 0.0})

    def play(n: int) -> Counter:
        seen = Counter()
        for _ in range(n):
            problem = actor.problems[actor._take_problem()]
            seen[problem["domain"]] += 1
            results = [right] * 4 if problem["domain"] == "easy" else [right, wrong, wrong, right]
            actor._stream_group([actor._sample("g", [1], [5], [-0.5], [0], "stop", r, {}, domain=problem["domain"])
                                 for r in results])
        return seen

    early = play(40)
    late = play(200)
    assert early["easy"] > 8  # at the start, the task's own shares (half each)
    assert late["hard"] > 0.8 * 200, late  # expected 10/11 once easy is at its floor
    actor.pool = type("NoPool", (), {"stats": staticmethod(dict)})()
    actor._report()
    row = json.loads((tmp_path / "run" / "actor_metrics.jsonl").read_text().splitlines()[-1])
    assert row["domain_easy_curriculum_share"] == pytest.approx(1 / 11, rel=0.05)
    assert row["domain_hard_curriculum_pass_rate"] == pytest.approx(0.5, abs=0.01)
    actor.samples.close()
    actor.state_file.close()
    again = Actor(cfg, [])
    assert again.curriculum.pass_rate == pytest.approx(actor.curriculum.pass_rate)
    again.samples.close()


def test_a_curriculum_that_would_do_nothing_is_refused_by_name(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="actor.curriculum: must be one of learnability, unsolved or null"):
        mix_config(tmp_path, tiny_model_dir, "actor.curriculum=easy_first")
    with pytest.raises(ConfigError, match="actor.curriculum_floor: must be in"):
        mix_config(tmp_path, tiny_model_dir, "actor.curriculum_floor=0")
    one = load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "actor.curriculum=unsolved"])
    with pytest.raises(ConfigError, match="actor.curriculum: task 'arithmetic' has no domains"):
        Actor(one, [])
    assert Actor(mix_config(tmp_path, tiny_model_dir), []).curriculum is None  # off by default
