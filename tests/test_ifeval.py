"""The ifeval task and reward: IFEval's own checkers (lm-eval's registry), its JSONL format, strict and loose levels,
the procedural generator, and checkers that cannot run offline said loudly."""

from __future__ import annotations

import json
import warnings

import pytest

pytest.importorskip("lm_eval")

from pipelinerl.eval import summarize  # noqa: E402
from pipelinerl.rewards.ifeval import EVAL_RATIOS, follows, ifeval_reward, score_ifeval, unavailable_instructions  # noqa: E402
from pipelinerl.rewards.pool import RewardPool  # noqa: E402
from pipelinerl.tasks import get_task  # noqa: E402
from pipelinerl.tasks.base import reward_item  # noqa: E402
from pipelinerl.tasks.ifeval import IFEvalTask, read_ifeval_jsonl  # noqa: E402

NLTK_IDS = {"length_constraints:number_sentences", "change_case:capital_word_frequency"}


def _has_punkt() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        return True
    except LookupError:
        return False


def problem(ids: list[str], kwargs: list[dict], prompt: str = "Write about rain.") -> dict:
    return {"prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


@pytest.mark.parametrize("ids, kwargs, good, bad", [
    (["startend:quotation"], [{}], '"rain falls"', "rain falls"),
    (["punctuation:no_comma"], [{}], "rain falls and stops", "rain falls, and stops"),
    (["startend:end_checker"], [{"end_phrase": "Any other questions?"}], "Rain. Any other questions?",
     "Any other questions? Rain."),
    (["keywords:existence"], [{"keywords": ["river", "stone"]}], "a river and a stone", "a river alone"),
    (["keywords:forbidden_words"], [{"forbidden_words": ["wet"]}], "rain is cold", "rain is wet"),
    (["detectable_format:json_format"], [{}], '{"rain": 1}', "rain: 1"),
    (["detectable_content:postscript"], [{"postscript_marker": "P.S."}], "Rain.\nP.S. bring a coat", "Rain."),
    (["length_constraints:number_words"], [{"num_words": 3, "relation": "less than"}], "rain falls",
     "rain falls all day"),
    (["detectable_format:number_bullet_lists"], [{"num_bullets": 2}], "* rain\n* snow", "* rain"),
])
def test_the_reward_is_ifevals_verdict(ids, kwargs, good, bad):
    p = problem(ids, kwargs)
    assert ifeval_reward(p, good).reward == 1.0
    result = ifeval_reward(p, bad)
    assert result.reward == 0.0 and ids[0] in result.info


def test_strict_and_loose_levels_and_the_fraction_reward():
    p = problem(["startend:quotation", "punctuation:no_comma"], [{}, {}])
    # a preface line: strict fails the quotation, loose (IFEval's first line removed) passes it
    response = 'Sure here it is\n"rain falls"'
    strict, loose = follows(p, response)
    assert strict == [False, True] and loose == [True, True]
    r = ifeval_reward(p, response)
    assert r.reward == 0.0 and r.parts["prompt_strict"] == 0.0 and r.parts["prompt_loose"] == 1.0
    assert r.parts["followed_strict"] == 1.0 and r.parts["followed_loose"] == 2.0 and r.parts["instructions"] == 2.0
    assert ifeval_reward(p, response, reward="fraction").reward == 0.5
    assert score_ifeval(reward_item({**p, "reward": "fraction"}, response, "stop")).reward == 0.5


def test_the_held_out_numbers_are_ifevals_prompt_mean_and_pooled_instruction_level():
    # prompt 1: 1 instruction, followed (strict and loose); prompt 2: 3 instructions, 1 followed strict, 3 loose
    rows = [{"benchmark": "ifeval", "correct": [1.0], "parts": {"prompt_strict": 1, "prompt_loose": 1,
                                                               "followed_strict": 1, "followed_loose": 1,
                                                               "instructions": 1}},
            {"benchmark": "ifeval", "correct": [0.0], "parts": {"prompt_strict": 0, "prompt_loose": 1,
                                                               "followed_strict": 1, "followed_loose": 3,
                                                               "instructions": 3}},
            {"benchmark": "arithmetic", "correct": [1.0]}]
    result = summarize(rows, 1, EVAL_RATIOS)
    ifeval, arithmetic = result["benchmarks"]
    assert ifeval["prompt_level_strict_acc"] == 0.5 and ifeval["prompt_level_loose_acc"] == 1.0
    assert ifeval["inst_level_strict_acc"] == 2 / 4 and ifeval["inst_level_loose_acc"] == 4 / 4  # pooled, not 0.67
    assert "ratios" not in arithmetic and "prompt_level_strict_acc" not in arithmetic
    from pipelinerl.eval import markdown_table, metrics_row

    assert metrics_row(result)["eval_ifeval_inst_level_strict_acc"] == 0.5
    assert "inst_level_loose_acc" in markdown_table(result)


def test_reads_ifevals_jsonl_with_its_null_arguments(tmp_path):
    path = tmp_path / "input_data.jsonl"
    records = [
        {"key": 1000, "prompt": "Write a poem. Do not use commas.", "instruction_id_list": ["punctuation:no_comma"],
         "kwargs": [{}]},
        # the hub's copy writes every argument of every checker, unused ones as null
        {"key": 1001, "prompt": "Write about stones. End with 'Is there anything else I can help with?'.",
         "instruction_id_list": ["startend:end_checker", "keywords:existence"],
         "kwargs": [{"end_phrase": "Is there anything else I can help with?", "num_words": None, "keywords": None},
                    {"keywords": ["stone"], "end_phrase": None}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    task = get_task("ifeval", eval_data=str(path), num_train=20)
    evals = task.eval_problems()
    assert [p["key"] for p in evals] == [1000, 1001] and evals[1]["kwargs"][1] == {"keywords": ["stone"]}
    assert ifeval_reward(evals[1], "a stone. Is there anything else I can help with?").reward == 1.0
    assert task.prompt(evals[0]).startswith("Write a poem.")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"key": 1, "prompt": "x", "instruction_id_list": ["punctuation:no_comma"]}) + "\n")
    with pytest.raises(ValueError, match="record 0 lacks \\['kwargs'\\]"):
        read_ifeval_jsonl(bad)
    bad.write_text(json.dumps({"prompt": "x", "instruction_id_list": ["no:such"], "kwargs": [{}]}) + "\n")
    with pytest.raises(ValueError, match="unknown instructions \\['no:such'\\]"):
        read_ifeval_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="google/IFEval"):
        read_ifeval_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.skipif(_has_punkt(), reason="NLTK's punkt_tab is installed here: every checker runs")
def test_checkers_that_need_nltk_data_are_refused_by_name_or_left_out_and_never_score_zero(tmp_path):
    assert set(unavailable_instructions()) == NLTK_IDS
    path = tmp_path / "input_data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"key": 1, "prompt": "Answer in 3 sentences.", "instruction_id_list": ["length_constraints:number_sentences"],
         "kwargs": [{"num_sentences": 3, "relation": "less than"}]},
        {"key": 2, "prompt": "No commas.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    ]) + "\n")
    with pytest.raises(ValueError, match="number_sentences.*punkt_tab.*unavailable: skip"):
        IFEvalTask(eval_data=str(path))
    with pytest.raises(ValueError, match="instructions: cannot check change_case:capital_word_frequency"):
        IFEvalTask(instructions=["change_case:capital_word_frequency"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = IFEvalTask(eval_data=str(path), unavailable="skip")
    assert [p["key"] for p in task.eval_problems()] == [2]
    assert any("left out 1 of 2" in str(w.message) for w in caught)
    # the generator never draws them unless asked
    assert not NLTK_IDS & {i for p in IFEvalTask(num_train=200, num_eval=0).train_problems()
                           for i in p["instruction_id_list"]}
    # scored anyway (a prompt from elsewhere), it is an error the pool counts, not a reward of 0
    unscorable = problem(["length_constraints:number_sentences"], [{"num_sentences": 3, "relation": "less than"}])
    with RewardPool(workers=1) as pool:
        [result] = pool.score(score_ifeval, [reward_item(unscorable, "One. Two.", "stop")])
        assert result.info.startswith("error:") and "punkt_tab" in result.info
        assert pool.stats()["errors"] == 1 and pool.stats()["scored"] == 0


def test_generated_prompts_are_seeded_disjoint_and_never_ask_conflicting_constraints():
    from pipelinerl.rewards.ifeval import conflicts

    task = IFEvalTask(num_train=400, num_eval=60, max_instructions=3, seed=3)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(held_out) == 60 and len(train) == 400
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}
    again = IFEvalTask(num_train=400, num_eval=60, max_instructions=3, seed=3)
    assert [p["prompt"] for p in again.train_problems()] == [p["prompt"] for p in train]
    assert [p["prompt"] for p in IFEvalTask(num_train=10, num_eval=60, max_instructions=3, seed=3).eval_problems()] \
        == [p["prompt"] for p in held_out]  # the held-out set does not depend on num_train
    assert max(len(p["instruction_id_list"]) for p in train) == 3
    table = conflicts()
    for p in train + held_out:
        ids = p["instruction_id_list"]
        assert len(ids) == len(p["kwargs"])
        for i, a in enumerate(ids):
            assert not any(b in table[a] for b in ids[i + 1:]), ids
    # the wording is the checker's own description, with the drawn arguments
    words = [p for p in train if p["instruction_id_list"] == ["keywords:existence"]][0]
    assert all(k in words["prompt"] for k in words["kwargs"][0]["keywords"])


def test_targets_follow_what_they_can_write_checked_by_ifevals_checkers():
    writable = ["startend:quotation", "punctuation:no_comma", "startend:end_checker", "detectable_content:postscript",
                "keywords:existence", "keywords:forbidden_words", "keywords:frequency", "detectable_format:title",
                "length_constraints:number_words"]
    task = IFEvalTask(num_train=300, num_eval=0, max_instructions=3, instructions=writable, seed=1)
    rewards = [ifeval_reward(p, task.target(p)).reward for p in task.train_problems()]
    assert sum(rewards) == len(rewards)


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="reward must be one of all, fraction"):
        IFEvalTask(reward="most")
    with pytest.raises(ValueError, match="instructions: unknown \\['keywords:nope'\\]"):
        IFEvalTask(instructions=["keywords:nope"])
    with pytest.raises(ValueError, match="unavailable must be one of error, skip"):
        IFEvalTask(unavailable="ignore")


def test_a_mixs_ifeval_domain_warms_up_before_the_workers_clock_starts():
    # lm-eval's import takes seconds: inside the 2 s a check may take here, a cold worker would time out on the
    # first instruction-following answer, and every replacement worker again
    from pipelinerl.tasks.base import reward_preload
    from pipelinerl.tasks.mix import MixTask

    mix = MixTask({"constraints": {"task": "ifeval", "args": {"num_train": 10, "num_eval": 0,
                                                             "instructions": ["startend:quotation"]}}})
    problems = mix.train_problems()[:3]
    assert reward_preload(mix) == ("pipelinerl.rewards.ifeval:score_ifeval",)
    with RewardPool(workers=1, timeout_s=2.0, preload=reward_preload(mix)) as pool:
        results = pool.score(mix.reward_fn, [reward_item(p, '"i like rain"', "stop") for p in problems])
        assert [r.reward for r in results] == [1.0] * 3, [r.info for r in results]
        assert pool.stats()["timeouts"] == 0
