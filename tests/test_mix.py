"""Several domains in one run (`task.name: mix`, pipelinerl/tasks/mix.py): shares by weight, every problem tagged
with its domain, each domain's prompt and verifier kept (routed in the reward workers), each domain's numbers
reported apart in the trainer's metrics and as its own held-out benchmark."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.eval import benchmark_of
from pipelinerl.rewards import RewardPool
from pipelinerl.samples import Sample
from pipelinerl.tasks import reward_item, task_from_config
from pipelinerl.tasks.base import reward_preload
from pipelinerl.tasks.mix import MixTask
from pipelinerl.train import batch_metrics

pytest.importorskip("reasoning_gym", reason="the reasoning extra: pip install -e '.[reasoning]'")

DOMAINS = {"add": {"task": "arithmetic", "weight": 3, "args": {"digits": 2, "ops": "+", "num_train": 50,
                                                               "num_eval": 10}},
           "legs": {"task": "reasoning_gym", "weight": 1, "args": {"datasets": ["leg_counting"], "num_train": 20,
                                                                   "num_eval": 5}}}


def test_domains_share_the_training_problems_by_weight_and_keep_their_prompts_and_verifiers():
    mix = MixTask(DOMAINS, num_train=400, seed=1)
    train, held_out = mix.train_problems(), mix.eval_problems()
    assert Counter(p["domain"] for p in train) == {"add": 300, "legs": 100}
    assert Counter(p["domain"] for p in held_out) == {"add": 10, "legs": 5}  # every held-out problem, unweighted
    assert len({p["id"] for p in train}) == 70  # the domains' own 50 and 20, repeated to their shares
    add = next(p for p in held_out if p["domain"] == "add")
    legs = next(p for p in held_out if p["domain"] == "legs")
    assert mix.prompt(add) == mix.tasks["add"].prompt(add) and mix.prompt(legs).endswith("\nAnswer:")
    assert {benchmark_of(p, mix) for p in held_out} == {"add", "legs"}  # one held-out benchmark per domain
    items = [reward_item(add, add["answer"], "stop"), reward_item(add, "x", "stop"),
             reward_item(legs, f" {legs['answer']}", "stop"), reward_item(legs, " 0", "stop")]
    with RewardPool(1, 10.0) as pool:
        results = pool.score(mix.reward_fn, items)
    assert [r.parts["correct"] for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert results[2].info.startswith("legs: leg_counting")  # routed to Reasoning Gym's own scorer


def test_each_domains_numbers_are_logged_apart():
    def sample(domain: str, reward: float, n: int) -> Sample:
        return Sample(group_id=domain, prompt_token_ids=[1], output_token_ids=[2] * n, behav_logprobs=[0.0] * n,
                      versions=[0] * n, finish_reason="stop", reward=reward, reward_parts={"correct": reward},
                      domain=domain)

    row = batch_metrics([sample("add", 1.0, 2), sample("add", 0.0, 2), sample("leg counting", 1.0, 6)])
    assert row["domain_add_reward_mean"] == 0.5 and row["domain_add_output_tokens_mean"] == 2
    assert row["domain_leg_counting_accuracy"] == 1.0 and row["domain_leg_counting_samples"] == 1
    assert row["reward_mean"] == pytest.approx(2 / 3)
    assert not any(k.startswith("domain_") for k in batch_metrics([sample("", 1.0, 1)]))  # one-domain tasks
    stale = sample("legs", 1.0, 2).model_copy(update={"versions": [1, 2]})
    row = batch_metrics([sample("add", 1.0, 2), stale], trained_at=3)  # lag from each sample's first token
    assert row["domain_add_lag_mean"] == 3 and row["domain_legs_lag_mean"] == 2


def test_a_mix_from_a_recipe_and_its_mistakes_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\ntask:\n  name: mix\n  args:\n    domains:\n"
                      "      add: {task: arithmetic, args: {digits: 1, num_train: 20, num_eval: 4}}\n"
                      "      legs: {task: reasoning_gym, args: {datasets: [leg_counting], num_train: 5}}\n")
    task = task_from_config(load_config(recipe).task)
    assert sorted(task.domains()) == ["add", "legs"] and len(task.train_problems()) == 25
    with pytest.raises(ConfigError, match="task.args: mix refused its arguments: domains.legs \\(reasoning_gym\\)"):
        task_from_config(load_config(recipe, ["task.args.domains.legs.args.datasets=[nope]"]).task)
    with pytest.raises(ConfigError, match="domains.add.weight must be a number > 0"):
        task_from_config(load_config(recipe, ["task.args.domains.add.weight=0"]).task)
    with pytest.raises(ConfigError, match="domains.add: takes task \\(required\\), weight, args, sampling and"):
        task_from_config(load_config(recipe, ["task.args.domains.add.colour=red"]).task)
    with pytest.raises(ConfigError, match="domains.x: a mix cannot hold another mix"):
        task_from_config(load_config(recipe, ["task.args.domains.x={task: mix}"]).task)


def test_a_domains_own_sampling_settings_and_warm_up_targets():
    from pipelinerl.tasks.base import problem_sampling

    domains = {**DOMAINS, "legs": {**DOMAINS["legs"], "sampling": {"max_new_tokens": 5, "stop": "\n"}}}
    task = MixTask(domains)
    legs = [p for p in task.train_problems() if p["domain"] == "legs"]
    adds = [p for p in task.train_problems() if p["domain"] == "add"]
    assert problem_sampling(legs[0], 64, ["</answer>"]) == (5, ["\n"])
    assert problem_sampling(adds[0], 64, ["</answer>"]) == (64, ["</answer>"])  # the run's, where a domain has none
    assert problem_sampling(task.eval_problems()[-1], 64, []) == (5, ["\n"])  # held out too
    # every domain writes its own warm-up target; what its verifier scores right
    with RewardPool(workers=1, preload=reward_preload(task)) as pool:  # Reasoning Gym's import before the clock
        results = pool.score(task.reward_fn, [reward_item(p, task.target(p), "stop") for p in legs[:3] + adds[:3]])
    assert all(r.reward == 1.0 for r in results), [r.info for r in results]
    for bad in ({"max_new_tokens": 0}, {"temperature": 0.5}):
        with pytest.raises(ValueError, match="domains.legs.sampling"):
            MixTask({**DOMAINS, "legs": {**DOMAINS["legs"], "sampling": bad}})


def score_after_sleeping(item: dict) -> float:
    time.sleep(item["problem"]["sleep"])
    return 1.0


class SleepyTask:
    """A one-file task (as a user would write one) whose verifier takes `sleep` seconds."""

    name = "sleepy"
    reward_fn = staticmethod(score_after_sleeping)

    def __init__(self, sleep: float):
        self.sleep = sleep

    def train_problems(self) -> list[dict]:
        return [{"id": i, "sleep": self.sleep} for i in range(4)]

    def eval_problems(self) -> list[dict]:
        return self.train_problems()

    def prompt(self, problem: dict) -> str:
        return "wait"


def test_a_domains_own_reward_timeout_bounds_its_checks_and_no_one_elses():
    """A slow verifier's domain gets its own bound (`reward_timeout_s`), wider or narrower than the run's; the
    other domains keep the run's `reward.timeout_s`."""
    task = MixTask({"quick": {"task": "test_mix:SleepyTask", "args": {"sleep": 0.6}},
                    "patient": {"task": "test_mix:SleepyTask", "args": {"sleep": 0.6}, "reward_timeout_s": 5},
                    "strict": {"task": "test_mix:SleepyTask", "args": {"sleep": 2.0}, "reward_timeout_s": 0.2}})
    first = {name: next(p for p in task.eval_problems() if p["domain"] == name) for name in task.domains()}
    with RewardPool(workers=1, timeout_s=0.3, preload=reward_preload(task)) as pool:
        results = {name: pool.score(task.reward_fn, [reward_item(p, "", "stop")])[0] for name, p in first.items()}
        counts = pool.stats()
    assert results["patient"].reward == 1.0, results["patient"].info  # 0.6 s inside its own 5 s
    assert results["quick"].info == "timeout: no result within 0.3 s"  # the run's bound
    assert results["strict"].info == "timeout: no result within 0.2 s"  # its own, narrower
    assert counts["timeouts"] == 2 and counts["scored"] == 1
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="domains.strict.reward_timeout_s must be a number of seconds > 0"):
            MixTask({"strict": {"task": "test_mix:SleepyTask", "args": {"sleep": 0}, "reward_timeout_s": bad}})


def test_a_code_domain_bounded_below_its_own_budget_is_refused_before_the_run(tmp_path):
    from pipelinerl.launch.preflight import preflight
    from pipelinerl.placement import NodeEnv

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {{path: m, init: tiny}}\ntask:\n  name: mix\n  args:\n"
                      "    domains:\n      add: {task: arithmetic, args: {digits: 1, num_train: 20, num_eval: 4}}\n"
                      "      code: {task: 'pipelinerl.tasks.tiny_code:TinyCodeTask',\n"
                      "             args: {total_time_s: 20, num_train: 20, num_eval: 4}}\n")
    with pytest.raises(ConfigError, match="reward.timeout_s: 5 s would cut off the checks of a code answer.*set "
                                          "task.args.domains.code.reward_timeout_s above that"):
        preflight(load_config(recipe), str(recipe), NodeEnv(), 0)
    with pytest.raises(ConfigError, match="task.args.domains.code.reward_timeout_s: 10 s would cut off"):
        preflight(load_config(recipe, ["task.args.domains.code.reward_timeout_s=10"]), str(recipe), NodeEnv(), 0)
    problems, _ = preflight(load_config(recipe, ["task.args.domains.code.reward_timeout_s=25"]), str(recipe),
                            NodeEnv(), 0)
    assert not any("timeout" in p for p in problems)
