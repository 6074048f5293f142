"""STEM multiple choice (`task.name: multiple_choice`): MMLU-Pro, GPQA, SciQ and plain layouts, any number of
options, a seeded shuffle per problem with the gold letter tracked, and the usual answer forms read."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pipelinerl.rewards import RewardPool
from pipelinerl.rewards.choice import extract_choice, score_multiple_choice
from pipelinerl.tasks import get_task, reward_item
from pipelinerl.tasks.multiple_choice import MultipleChoiceTask, read_choice_file

CHOICES = {"A": "1 m", "B": "5 m/s", "C": "a cat", "D": "d"}


@pytest.mark.parametrize("reply, letter", [
    ("Answer: B", "B"), ("The answer is (B).", "B"), ("(B)", "B"), ("B.", "B"), ("B", "B"), ("B) 5 m/s", "B"),
    ("We get 5 m/s, so \\boxed{B}", "B"), ("\\boxed{(C)}", "C"), ("answer: b", "B"), ("the correct option is C", "C"),
    ("A looks right but it is not. Answer: D", "D"), ("ANSWER IS D", "D"),
    ("The answer is a bit tricky. Answer: C", "C"), ("5 m/s", "B"),
])
def test_the_usual_answer_forms_pick_their_letter(reply, letter):
    assert extract_choice(reply, CHOICES)[0] == letter


@pytest.mark.parametrize("reply, why", [
    ("hello", "no option letter found"), ("Answer: E", "E is not an option"), ("", "no option letter found"),
])
def test_a_reply_without_a_valid_letter_says_why(reply, why):
    letter, how = extract_choice(reply, CHOICES)
    assert letter is None and why in how


def write(path, records, jsonl=False):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records))
    return str(path)


def test_every_layout_and_any_number_of_options(tmp_path):
    mmlu = write(tmp_path / "mmlu_pro.jsonl", [{"question_id": 7, "question": "q1", "options": list("0123456789"),
                                                "answer": "H", "answer_index": 7, "category": "math"}], jsonl=True)
    gpqa = write(tmp_path / "gpqa.json", [{"Question": "q2", "Correct Answer": "right", "Incorrect Answer 1": "w1",
                                           "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"}])
    sciq = write(tmp_path / "sciq.json", [{"question": "q3", "correct_answer": "ok", "distractor1": "n1",
                                           "distractor2": "n2", "distractor3": "n3", "support": ""}])
    plain = write(tmp_path / "plain.json", [{"question": "q4", "choices": ["yes", "no"], "answer": 1},
                                            {"question": "q5", "choices": {"A": "x", "B": "y", "C": "z"},
                                             "answer": "C"},
                                            {"problem": "q6", "choices": ["p", "q", "r"], "answer": "q"}])
    golds = {p["question"]: p["options"][p["gold"]] for f in (mmlu, gpqa, sciq, plain) for p in read_choice_file(f)}
    assert golds == {"q1": "7", "q2": "right", "q3": "ok", "q4": "no", "q5": "z", "q6": "q"}
    task = get_task("multiple_choice", eval_data=[mmlu, gpqa, sciq, plain])
    by_question = {p["question"]: p for p in task.eval_problems()}
    assert len(by_question["q1"]["choices"]) == 10 and len(by_question["q4"]["choices"]) == 2
    for q, gold in golds.items():  # wherever the shuffle put it, the gold letter is the gold option's
        p = by_question[q]
        assert p["choices"][p["answer"]] == gold
    assert [p["source"] for p in task.eval_problems()][:3] == ["mmlu_pro", "gpqa", "sciq"]  # one benchmark each
    assert "J. " in task.prompt(by_question["q1"]) and "Answer: X" in task.prompt(by_question["q1"])


def test_the_shuffle_is_seeded_per_problem_and_moves_the_gold_letter(tmp_path):
    records = [{"Question": f"q{i}", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
                "Incorrect Answer 3": "w3"} for i in range(200)]
    path = write(tmp_path / "gpqa.json", records)
    task = MultipleChoiceTask(eval_data=path, seed=1)
    letters = Counter(p["answer"] for p in task.eval_problems())
    assert set(letters) == {"A", "B", "C", "D"} and min(letters.values()) > 25  # GPQA's gold is always first
    again = MultipleChoiceTask(eval_data=path, seed=1)
    assert [p["choices"] for p in again.eval_problems()] == [p["choices"] for p in task.eval_problems()]
    other = MultipleChoiceTask(eval_data=path, seed=2)
    assert [p["answer"] for p in other.eval_problems()] != [p["answer"] for p in task.eval_problems()]
    fixed = MultipleChoiceTask(eval_data=path, shuffle=False)
    assert {p["answer"] for p in fixed.eval_problems()} == {"A"}


def test_rewards_through_the_pool_and_held_out_questions_never_trained_on(tmp_path):
    records = [{"question": f"q{i}", "correct_answer": f"ok{i}", "distractor1": "n1", "distractor2": "n2",
                "distractor3": "n3"} for i in range(30)]
    train = write(tmp_path / "train.json", records)
    held_out = write(tmp_path / "test.json", records[:5])
    task = MultipleChoiceTask(train_data=train, eval_data=held_out, num_train=20)
    assert len(task.train_problems()) == 20
    assert not {p["question"] for p in task.train_problems()} & {p["question"] for p in task.eval_problems()}
    problems = task.train_problems()[:4]
    wrong = {p["id"]: next(k for k in p["choices"] if k != p["answer"]) for p in problems}
    items = [reward_item(p, task.target(p), "stop") for p in problems]
    items += [reward_item(p, f"Answer: {wrong[p['id']]}", "stop") for p in problems]
    with RewardPool(workers=1) as pool:
        results = pool.score(score_multiple_choice, items)
    assert [r.reward for r in results] == [1.0] * 4 + [0.0] * 4
    assert all("wrong option" in r.info for r in results[4:])


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="train_data or eval_data"):
        MultipleChoiceTask()
    bad = write(tmp_path / "bad.json", [{"question": "q", "choices": ["a", "b"], "answer": "z"}])
    with pytest.raises(ValueError, match="bad.json: record 0: answer 'z' is neither"):
        MultipleChoiceTask(eval_data=bad)
    one = write(tmp_path / "one.json", [{"question": "q", "choices": ["a"], "answer": 0}])
    with pytest.raises(ValueError, match="record 0 has 1 options"):
        MultipleChoiceTask(eval_data=one)
    with pytest.raises(ValueError, match="no question and options"):
        MultipleChoiceTask(eval_data=write(tmp_path / "odd.json", [{"text": "q"}]))
