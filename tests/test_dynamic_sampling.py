"""Dynamic sampling in the actor: groups are kept or dropped by correctness, not by the shaped reward."""

import json

import pytest

from pipelinerl.actor import Actor, InPlaceFile, dynamic_sampling_drop
from pipelinerl.config import ConfigError, load_config
from pipelinerl.contracts.inference import Completion
from pipelinerl.rewards import RewardResult
from pipelinerl.samples import Sample
from pipelinerl.streams import open_reader


def scored(correct: bool, reward: float) -> Sample:
    return Sample(group_id="g", prompt_token_ids=[1], output_token_ids=[2], behav_logprobs=[-0.1], versions=[0],
                  finish_reason="stop", reward=reward, reward_parts={"correct": float(correct)})


def test_the_decision_reads_correctness():
    # all wrong, rewards spread by a length penalty: nothing to learn about being right
    assert dynamic_sampling_drop([scored(False, -0.1), scored(False, -0.7), scored(False, 0.0)]) == "all_wrong"
    assert dynamic_sampling_drop([scored(True, 1.9), scored(True, 1.2)]) == "all_correct"
    # mixed correctness is kept, even where shaping gave a right and a wrong answer the same reward
    assert dynamic_sampling_drop([scored(True, 0.0), scored(False, 0.0)]) is None
    assert dynamic_sampling_drop([scored(False, 0.0)]) is None  # a group of one: nothing to compare within


def completion(length: int, finish_reason: str = "stop") -> Completion:
    return Completion(token_ids=[5] * length, logprobs=[-0.5] * length, versions=[0] * length,
                      finish_reason=finish_reason)


def test_actor_drops_groups_without_a_correctness_signal(tmp_path, tiny_model_dir):
    """Through the actor's own scoring (`_sample`, which shapes the reward) and streaming (`_stream_group`): an
    all-wrong group whose shaped rewards differ by length is dropped and counted; a mixed group is streamed whole."""
    cfg = load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=3",
                             "trainer.samples_per_step=3", "sampling.max_new_tokens=100", "reward.overlong_buffer=50",
                             "actor.dynamic_sampling=true"])
    actor = Actor(cfg, [])
    wrong, right = RewardResult(0.0, {"correct": 0.0}), RewardResult(1.0, {"correct": 1.0})

    def group(name: str, outcomes: list[tuple[int, RewardResult]]) -> list[Sample]:
        return [actor._sample(name, [1, 2], c.token_ids, c.logprobs, c.versions, c.finish_reason, r, {})
                for c, r in ((completion(n), r) for n, r in outcomes)]

    all_wrong = group("wrong", [(10, wrong), (75, wrong), (100, wrong)])
    assert len({s.reward for s in all_wrong}) == 3  # the overlong penalty makes the rewards differ
    actor._stream_group(all_wrong)
    all_right = group("right", [(10, right), (20, right), (30, right)])
    actor._stream_group(all_right)
    mixed = group("mixed", [(10, right), (90, wrong), (100, wrong)])
    actor._stream_group(mixed)
    actor.samples.close()

    streamed = [Sample.model_validate(r) for r in open_reader(cfg.streams, tmp_path, "samples").read()]
    assert [s.group_id for s in streamed] == ["mixed"] * 3
    assert [s.reward_parts["correct"] for s in streamed] == [1.0, 0.0, 0.0]
    assert actor.counts["groups_dropped_all_wrong"] == actor.counts["groups_dropped_all_correct"] == 1
    assert actor.counts["groups_streamed"] == 1 and actor.streamed == 3
    # every answer scored counts towards the policy's accuracy, the dropped groups' too: 4 right of 9
    assert (actor.counts["samples_generated"], actor.counts["samples_generated_correct"]) == (9, 4)
    assert json.loads(actor.state_path.read_text())["streamed_samples"] == 3
    actor.state_file.close()
    # a restarted actor goes on from there: the stream's length (for max_lag) and the next problem
    again = Actor(cfg, [])
    assert (again.streamed, again.next_problem) == (3, actor.next_problem)
    again.state_file.close()


def test_the_state_file_is_rewritten_in_place(tmp_path):
    path = tmp_path / "state.json"
    f = InPlaceFile(path)
    f.write(json.dumps({"next_problem": 123456}))
    f.write(json.dumps({"next_problem": 7}))  # shorter: no tail of the longer text is left
    assert json.loads(path.read_text()) == {"next_problem": 7}
    f.close()
    f = InPlaceFile(path)  # reopened on a resume
    f.write(json.dumps({"a": 1}))
    assert json.loads(path.read_text()) == {"a": 1}
    f.close()


def test_actor_stops_the_run_only_when_the_policy_gets_nothing_right(tmp_path, tiny_model_dir):
    """A collapsed policy (every group all wrong) would make the actor regenerate forever: after
    `actor.max_dropped_in_a_row` all-wrong groups in a row it stops with the reason; a kept group starts the count
    again, and an all-right group is no collapse: it neither counts nor resets (its problem is retired)."""
    cfg = load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=2",
                             "trainer.samples_per_step=2", "actor.dynamic_sampling=true",
                             "actor.max_dropped_in_a_row=3"])
    actor = Actor(cfg, [])
    wrong, right = RewardResult(0.0, {"correct": 0.0}), RewardResult(1.0, {"correct": 1.0})

    def group(*results: RewardResult) -> list[Sample]:
        return [actor._sample("g", [1, 2], [5], [-0.5], [0], "stop", r, {}) for r in results]

    for _ in range(2):
        actor._stream_group(group(wrong, wrong))
    actor._stream_group(group(right, wrong))  # kept: the count starts again
    for _ in range(5):
        actor._stream_group(group(right, right))  # solved: not a collapse
    actor._stream_group(group(wrong, wrong))
    actor._stream_group(group(wrong, wrong))
    assert actor.stalled is None and not actor.done
    actor._stream_group(group(right, right))
    actor._stream_group(group(wrong, wrong))
    assert actor.done and "dropped 3 groups in a row whose answers were all wrong" in actor.stalled
    assert "5 all wrong, 6 all right, 1 kept" in actor.stalled and "actor.max_dropped_in_a_row" in actor.stalled
    actor.samples.close()


def test_solved_problems_leave_the_pool_and_a_solved_pool_ends_the_run(tmp_path, tiny_model_dir):
    """ProRL / DAPO: a problem whose answers all came back right is not sampled again (and stays retired after a
    restart); once every problem is retired the actor ends the run as a success (no stall)."""
    base = [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=2",
            "trainer.samples_per_step=2", "actor.dynamic_sampling=true"]

    def actor_of_four_problems() -> Actor:
        actor = Actor(load_config(None, base), [])
        actor.problems, actor.order = actor.problems[:4], [2, 0, 3, 1]
        return actor

    actor = actor_of_four_problems()
    right = RewardResult(1.0, {"correct": 1.0})
    wrong = RewardResult(0.0, {"correct": 0.0})

    def group(*results: RewardResult) -> list[Sample]:
        return [actor._sample("g", [1, 2], [5], [-0.5], [0], "stop", r, {}) for r in results]

    solved = actor._take_problem()
    actor._stream_group(group(right, right), solved)
    actor._stream_group(group(right, wrong), actor._take_problem())  # kept: stays in the pool
    assert actor.retired == {solved} and actor.counts["problems_retired"] == 1
    assert solved not in {actor._take_problem() for _ in range(12)}
    actor.samples.close()
    actor.state_file.close()
    again = actor_of_four_problems()  # a restarted actor keeps its pool
    assert again.retired == {solved}
    for index in range(4):
        again._stream_group([again._sample("g", [1], [5], [-0.5], [0], "stop", right, {})] * 2, index)
    assert again._take_problem() is None and again.pool_solved and again.done and again.stalled is None
    again.samples.close()


def test_the_default_limit_is_ten_steps_of_groups(tmp_path, tiny_model_dir):
    base = [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=4",
            "trainer.samples_per_step=32"]
    for overrides, limit in (([], 80), (["actor.max_dropped_in_a_row=0"], 0)):
        actor = Actor(load_config(None, [*base, *overrides]), [])
        assert actor.max_dropped_in_a_row == limit
        actor.samples.close()
    with pytest.raises(ConfigError, match="actor.max_dropped_in_a_row"):
        load_config(None, [*base, "actor.max_dropped_in_a_row=-1"])


def test_the_actor_counts_the_batch_the_trainer_is_part_way_through(tmp_path, tiny_model_dir):
    """When the trainer drops stale groups it asks for more mid-batch, saying how many samples it took and how many
    of them are already in its batch. The samples queued fill the rest of that batch first, so a group started
    then is taken a version later than the queue's length alone says. Counted from the length alone, under dynamic
    sampling (whose dropped groups make the trainer ask often) the actor started groups that went stale: 22-25% of
    the samples taken in the ORZ rehearsal, against 11-13% counted right (docs/benchmarks.md)."""
    from pipelinerl.streams import open_writer

    cfg = load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=2",
                             "trainer.samples_per_step=4", "actor.max_lag=1", "trainer.max_steps=100"])
    actor = Actor(cfg, [])
    control = open_writer(cfg.streams, tmp_path, "control", "trainer")
    actor.streamed, actor.in_flight = 12, 2
    # at version 3 the trainer took 4 samples (2 fresh, 2 stale: 8 in all) and needs 2 more: of the 6 queued, 2
    # finish its batch and 4 make version 4's, so a group started now would be taken at version 5, lag 2
    control.write({"kind": "version", "version": 3, "consumed": 8, "taking": 2})
    actor._read_control()
    assert (actor.trainer_version, actor.trainer_consumed, actor.trainer_taking) == (3, 8, 2)
    assert not actor._may_start_group()
    # the batch done and the weights out: version 4, nothing of its batch taken yet; 4 queued, one step ahead
    control.write({"kind": "version", "version": 4, "consumed": 10})
    actor._read_control()
    assert (actor.trainer_version, actor.trainer_consumed, actor.trainer_taking) == (4, 10, 0)
    assert actor._may_start_group()
    # a message of an older version (read late) changes neither the version nor the batch's count
    control.write({"kind": "version", "version": 3, "consumed": 8, "taking": 2})
    actor._read_control()
    assert (actor.trainer_version, actor.trainer_taking) == (4, 0)


def test_the_launcher_ends_a_run_whose_pool_is_solved_as_a_success(tmp_path, capsys):
    """The actor's POOL_SOLVED_EXIT is no failure: the launcher stops following the run (then stops the trainer,
    which checkpoints) and says why, instead of reporting a dead actor."""
    import subprocess
    import sys

    from pipelinerl.launch import check_roles, follow_pipeline
    from pipelinerl.procs import POOL_SOLVED_EXIT

    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused"])
    actor = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({POOL_SOLVED_EXIT})"])
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        actor.wait(timeout=30)
        children = {"actor": actor, "trainer": trainer}
        check_roles(children, tmp_path)  # not a failure
        follow_pipeline(cfg, children, [], tmp_path, lambda: None)  # returns instead of waiting for the trainer
        assert trainer.poll() is None
        assert "the training problems were solved" in capsys.readouterr().err
    finally:
        trainer.kill()
        trainer.wait()


def test_a_pool_solved_but_for_a_few_hopeless_problems_ends_the_run_as_a_success(tmp_path, tiny_model_dir):
    """What a single-domain tiny_mix run hit: nearly every problem retired as solved, the few left all wrong group
    after group. That is no collapse (the policy solved its pool), so the run ends as a success, not a stall; the
    same run of drops over a pool of unsolved problems is still a stall."""
    base = [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "sampling.group_size=2",
            "trainer.samples_per_step=2", "actor.dynamic_sampling=true", "actor.max_dropped_in_a_row=6"]
    right, wrong = RewardResult(1.0, {"correct": 1.0}), RewardResult(0.0, {"correct": 0.0})

    def play(actor: Actor, solved: int) -> None:
        actor.problems = actor.problems[:10]
        for index in range(solved):
            actor._stream_group([actor._sample("g", [1], [5], [-0.5], [0], "stop", right, {})] * 2, index)
        while not actor.done:
            index = actor._take_problem()
            actor._stream_group([actor._sample("g", [1], [5], [-0.5], [0], "stop", wrong, {})] * 2, index)
        actor.samples.close()
        actor.state_file.close()

    nearly = Actor(load_config(None, base), [])
    play(nearly, solved=7)  # 3 left, each all wrong twice in the 6 drops
    assert nearly.pool_solved and nearly.stalled is None
    fresh = Actor(load_config(None, [*base[1:], f"run_dir={tmp_path / 'b'}"]), [])
    play(fresh, solved=0)  # 10 unsolved: the policy gets nothing right
    assert not fresh.pool_solved and "dropped 6 groups in a row" in fresh.stalled


def test_a_remainder_out_of_reach_ends_the_run_and_forgetting_stalls_it(tmp_path, tiny_model_dir):
    """What a single-domain IFEval run hit after 0.50 -> 0.975 held-out: most problems retired as solved, hundreds
    left that the policy never answered right, group after group all wrong. Each problem's recent pass rate tells
    that remainder (a success) from a policy that now gets wrong the problems it used to answer right (a stall);
    the record is kept across a restart, and a lucky answer long ago fades."""
    base = [f"model.path={tiny_model_dir}", "sampling.group_size=2", "trainer.samples_per_step=2",
            "actor.dynamic_sampling=true", "actor.max_dropped_in_a_row=6"]
    right, wrong = RewardResult(1.0, {"correct": 1.0}), RewardResult(0.0, {"correct": 0.0})
    learnable, hopeless = list(range(10)), list(range(10, 40))

    def actor_in(run_dir) -> Actor:
        actor = Actor(load_config(None, [f"run_dir={run_dir}", *base]), [])
        actor.problems = actor.problems[:40]
        return actor

    def answer(actor: Actor, index: int, *results: RewardResult) -> None:
        actor._stream_group([actor._sample("g", [1], [5], [-0.5], [0], "stop", r, {}) for r in results], index)

    def first_pass(actor: Actor) -> None:  # a learnable problem (kept) after every three hopeless ones
        for i in learnable:
            for h in hopeless[3 * i:3 * i + 3]:
                answer(actor, h, wrong, wrong)
            answer(actor, i, right, wrong)
        assert not actor.done and actor.dropped_in_a_row == 0

    reach = actor_in(tmp_path / "reach")
    first_pass(reach)
    for i in learnable:
        answer(reach, i, right, right)  # solved: retired
    for h in hopeless[:5]:
        answer(reach, h, wrong, wrong)
    reach.samples.close()
    reach.state_file.close()
    reach._save_history(force=True)
    again = actor_in(tmp_path / "reach")  # a restart keeps the pool and each problem's record
    assert again.retired == set(learnable) and again.history[10] == [0.0, 2]
    answer(again, hopeless[5], wrong, wrong)
    assert not again.done  # a restart starts a new run of drops: 1 of 6
    for h in hopeless[6:11]:
        answer(again, h, wrong, wrong)
    # 30 left of 40 (the few-left rule does not apply): 6 groups of problems never answered right
    assert again.pool_solved and again.done and again.stalled is None
    again.samples.close()

    forgot = actor_in(tmp_path / "forgot")
    first_pass(forgot)
    for i in (0, 10, 1, 11, 2, 3):  # four problems answered half right before, now all wrong
        answer(forgot, i, wrong, wrong)
    assert not forgot.pool_solved and "dropped 6 groups in a row" in forgot.stalled
    assert "at their past pass rates 4 of those answers would have been right" in forgot.stalled
    forgot.samples.close()

    faded = actor_in(tmp_path / "faded")
    first_pass(faded)  # each learnable problem half right once
    for _ in range(3):
        for i in learnable:
            answer(faded, i, wrong, wrong)
            answer(faded, hopeless[i], right, wrong)  # kept: the runs of drops stay short
    assert not faded.done and faded.history[0][0] == pytest.approx(0.0625)
    for i in (0, 1, 2, 3, 4, 5):  # answered right long ago, all wrong the last three times: out of reach now
        answer(faded, i, wrong, wrong)
    assert faded.pool_solved and faded.stalled is None
    faded.samples.close()
