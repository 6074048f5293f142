"""Tasks: the generated arithmetic task, math data loading in every supported format, and the registry."""

import json
import operator
import sys

import pytest

from pipelinerl.config import ConfigError, TaskConfig, load_config
from pipelinerl.models.tiny import CHARACTERS
from pipelinerl.rewards import RewardPool, function_ref
from pipelinerl.rewards.math import score_math
from pipelinerl.tasks import TASKS, Task, get_task, register_task, reward_item, task_from_config
from pipelinerl.tasks.arithmetic import ArithmeticTask, arithmetic_reward, parse_answer, sft_target, space_size
from pipelinerl.tasks.math_data import MathTask, load_file, load_hub, load_problems, score_math_task

# -- arithmetic ------------------------------------------------------------------------------------------------


def _keys(problems):
    return {(p["a"], p["op"], p["b"]) for p in problems}


def test_arithmetic_sets_are_disjoint_deterministic_and_sized():
    task = ArithmeticTask(digits=3, ops="+-*", num_train=3000, num_eval=300, seed=7)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(train) == len(_keys(train)) == 3000 and len(held_out) == len(_keys(held_out)) == 300
    assert not _keys(train) & _keys(held_out)
    again = ArithmeticTask(digits=3, ops="+-*", num_train=3000, num_eval=300, seed=7)
    assert again.train_problems() == train and again.eval_problems() == held_out
    other = ArithmeticTask(digits=3, ops="+-*", num_train=3000, num_eval=300, seed=8)
    assert other.train_problems() != train and other.eval_problems() != held_out
    # the held-out set does not depend on how much training data is asked for
    assert ArithmeticTask(digits=3, ops="+-*", num_train=10, num_eval=300, seed=7).eval_problems() == held_out
    assert {p["op"] for p in train} == {"+", "-", "*"}
    assert all(max(p["a"], p["b"]) < 100 for p in train if p["op"] == "*")  # mul_digits=2 keeps products short
    apply = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    assert all(int(p["answer"]) == apply[p["op"]](p["a"], p["b"]) for p in train + held_out)


def test_arithmetic_small_spaces_are_enumerated_and_overdraw_fails():
    assert space_size(1, "+", 2) == 100
    task = ArithmeticTask(digits=1, ops="+", num_train=80, num_eval=20)
    assert _keys(task.train_problems()) | _keys(task.eval_problems()) == {(a, "+", b) for a in range(10)
                                                                           for b in range(10)}
    with pytest.raises(ValueError, match="only 80 exist"):
        ArithmeticTask(digits=1, ops="+", num_train=81, num_eval=20).train_problems()
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="/")


def test_arithmetic_prompt_and_target_fit_the_char_vocabulary():
    task = ArithmeticTask(digits=4, ops="+-*", num_train=200, num_eval=20)
    problem = {"a": 12, "op": "+", "b": 345, "answer": "357"}
    assert task.prompt(problem) == "12+345=" and sft_target(problem) == "357"
    assert task.target(problem, eos="<eos>") == "357<eos>"
    for p in task.train_problems():
        assert set(task.prompt(p) + task.target(p)) <= set(CHARACTERS)


@pytest.mark.parametrize("completion, reward", [
    ("357", 1.0), ("357<eos>", 1.0), ("357\n12+1=13", 1.0), ("357+", 1.0), ("0357", 1.0),
    ("356", 0.0), ("3570", 0.0), (" 357", 0.0), ("", 0.0), ("=357", 0.0), ("-357", 0.0),
])
def test_arithmetic_verifier_reads_the_leading_integer(completion, reward):
    result = arithmetic_reward({"answer": "357"}, completion, "stop")
    assert result.reward == reward and result.parts == {"correct": reward}
    assert (result.info == "") == (reward == 1.0)


def test_arithmetic_negative_answers():
    assert parse_answer("-42=") == -42 and parse_answer("x") is None
    assert arithmetic_reward({"answer": "-42"}, "-42", "stop").reward == 1.0
    assert arithmetic_reward({"answer": "-42"}, "42", "stop").info == "wrong answer: 42, expected -42"


def test_arithmetic_reward_fn_runs_in_the_pool():
    task = get_task("arithmetic", digits=2, num_train=10, num_eval=4)
    problems = task.eval_problems()
    items = [reward_item(p, p["answer"] + "<eos>", "stop") for p in problems]
    items += [reward_item(p, str(int(p["answer"]) + 1), "length") for p in problems]
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        rewards = [r.reward for r in pool.score(task.reward_fn, items)]
    assert rewards == [1.0] * 4 + [0.0] * 4


# -- math data -------------------------------------------------------------------------------------------------

ORZ_EVAL = [
    {"prompt": [{"from": "user", "value": "What is $1+1$?"}], "final_answer": "2"},
    {"prompt": [{"from": "user", "value": "Simplify $\\frac{28}{6}$."}], "final_answer": "\\frac{14}{3}"},
]
ORZ_TRAIN = [[{"from": "human", "value": "Compute $3 \\cdot 4$."},
              {"from": "assistant", "ground_truth": {"value": "12"}}]]


def _write(path, records, jsonl=False):
    path.write_text("\n".join(json.dumps(r) for r in records) if jsonl else json.dumps(records))
    return path


def test_load_orz_eval_and_train_formats(tmp_path):
    problems = load_file(_write(tmp_path / "math_small.json", ORZ_EVAL))
    assert problems == [
        {"id": "math_small-0", "problem": "What is $1+1$?", "answer": "2", "source": "math_small"},
        {"id": "math_small-1", "problem": "Simplify $\\frac{28}{6}$.", "answer": "\\frac{14}{3}",
         "source": "math_small"},
    ]
    train = load_problems(str(_write(tmp_path / "orz_train.json", ORZ_TRAIN)))
    assert [(p["problem"], p["answer"]) for p in train] == [("Compute $3 \\cdot 4$.", "12")]


def test_load_plain_formats(tmp_path):
    records = [{"problem": "p1", "answer": 5, "unique_id": "test/algebra/1.json"},
               {"question": "p2", "answer": "Natalia sold 48 clips.\n#### 72"},
               {"problem": "p3", "solution": "so it is $\\boxed{\\frac{1}{2}}$."}]
    for name, jsonl in (("plain.jsonl", True), ("hf_dump.json", True), ("plain_list.json", False)):
        problems = load_file(_write(tmp_path / name, records, jsonl=jsonl))
        assert [(p["problem"], p["answer"]) for p in problems] == [("p1", "5"), ("p2", "72"), ("p3", "\\frac{1}{2}")]
        assert problems[0]["id"] == "test/algebra/1.json"


def test_load_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="record 1 has no recognisable problem and answer"):
        load_file(_write(tmp_path / "bad.json", [{"problem": "a", "answer": "1"}, {"text": "?"}]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(str(tmp_path / "missing.json"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `datasets` were not installed
    with pytest.raises(ImportError, match="pip install datasets.*local JSON/JSONL file"):
        load_hub("HuggingFaceH4/MATH-500")
    with pytest.raises(ImportError, match="datasets"):
        load_problems("HuggingFaceH4/aime_2024:train")


def test_math_task_prompts_and_reward_rules(tmp_path):
    path = str(_write(tmp_path / "eval.json", ORZ_EVAL))
    orz = get_task("math", train_data=[path], eval_data=[path, path])
    assert isinstance(orz, Task) and orz.rule == "orz" and orz.reward_fn is score_math_task
    assert len(orz.train_problems()) == 2 and len(orz.eval_problems()) == 4
    text = orz.prompt(orz.train_problems()[0])
    assert "<answer> </answer>" in text and "\\boxed{}" in text and "What is $1+1$?\nAssistant: <think>" in text
    boxed = MathTask(train_data=[path], template="boxed")
    assert boxed.rule == "math" and boxed.prompt({"problem": "Q"}).endswith("within \\boxed{}.")
    assert MathTask(train_data=[path], template="plain", reward="orz").rule == "orz"
    assert function_ref(orz.reward_fn) == "pipelinerl.tasks.math_data:score_math_task"
    # every problem carries its task's rule, which the one pool entry point dispatches on
    assert {p["reward_rule"] for p in orz.train_problems()} == {"orz"}
    assert {p["reward_rule"] for p in boxed.train_problems()} == {"math"}
    problem = orz.train_problems()[1]
    good = reward_item(problem, "<think>28/6</think> <answer> \\boxed{14/3} </answer>", "stop")
    assert orz.reward_fn(good).reward == 1.0
    assert orz.reward_fn(reward_item(problem, "<answer> \\boxed{14/3} </answer>", "length")).reward == 0.0
    boxed_problem = boxed.train_problems()[1]
    assert boxed.reward_fn(reward_item(boxed_problem, "so \\boxed{14/3}", "length")).reward == 1.0
    with pytest.raises(ValueError, match="template"):
        MathTask(template="chat")


# -- registry and config ---------------------------------------------------------------------------------------


class _Echo:
    name = "echo"
    reward_fn = staticmethod(score_math)

    def __init__(self, n=1):
        self.n = n

    def train_problems(self):
        return [{"problem": "q", "answer": "1"}] * self.n

    def eval_problems(self):
        return []

    def prompt(self, problem):
        return problem["problem"]


def test_registry(monkeypatch):
    with pytest.raises(KeyError, match="unknown task 'nope'.*arithmetic"):
        get_task("nope")
    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))  # the registry as it was, after the test
    register_task("echo", _Echo)
    task = get_task("echo", n=3)
    assert isinstance(task, Task) and len(task.train_problems()) == 3


def test_task_from_config(tmp_path):
    task = task_from_config(TaskConfig(args={"digits": 2, "ops": "*", "num_train": 50, "num_eval": 5}, seed=3))
    assert isinstance(task, ArithmeticTask) and task.mul_digits == 2 and len(task.train_problems()) == 50
    path = str(_write(tmp_path / "eval.json", ORZ_EVAL))
    math_task = task_from_config(TaskConfig(name="math", args={"train_data": [path], "template": "boxed"}))
    assert isinstance(math_task, MathTask) and math_task.rule == "math"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\n")
    cfg = load_config(recipe, ["task.name=math", f"task.args.train_data=[{path}]", "task.args.reward=math"])
    assert cfg.task.args == {"train_data": [path], "reward": "math"}
    for override, key in (("task.name=math", "task.args.train_data"), ("task.name=poetry", "task.name")):
        with pytest.raises(ConfigError, match=key):
            load_config(recipe, [override])
    # a value the task refuses names task.args and the argument, when the task is built (the launcher's preflight)
    for overrides, refusal in ((["task.args.ops=+/"], "ops must be"),
                               (["task.name=math", f"task.args.train_data=[{path}]", "task.args.template=chat"],
                                "template must be")):
        with pytest.raises(ConfigError, match=f"task.args.*{refusal}"):
            task_from_config(load_config(recipe, overrides).task)


def test_the_task_keys_of_the_last_release_are_read_as_task_args_with_a_warning(tmp_path):
    """`task.digits: 2` (recipe) and `task.digits=2` (command line), the form before the task's settings moved
    under task.args, still mean task.args.digits, for one release, with a FutureWarning naming the new key."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\ntask:\n  name: arithmetic\n  digits: 2\n  reverse: true\n")
    with pytest.warns(FutureWarning, match=r"task\.digits, task\.reverse -> write task\.args\.digits, "
                                           r"task\.args\.reverse"):
        cfg = load_config(recipe, [])
    with pytest.warns(FutureWarning) as warned:
        cfg = load_config(recipe, ["task.ops=+-"])
    assert [str(w.message).split(";")[0] for w in warned][-1] == "command line: task.ops -> write task.args.ops"
    assert cfg.task.args == {"digits": 2, "reverse": True, "ops": "+-"}
    task = task_from_config(cfg.task)
    assert (task.digits, task.reverse, task.ops) == (2, True, "+-")


def test_a_task_named_over_a_recipes_task_does_not_inherit_its_args(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\ntask:\n  name: arithmetic\n  args: {digits: 2}\n")
    cfg = load_config(recipe, ["task.name=math", "task.args.train_data=[x.json]"])
    assert cfg.task.args == {"train_data": ["x.json"]}
    assert load_config(recipe, ["task.name=arithmetic", "task.args.ops=+"]).task.args == {"digits": 2, "ops": "+"}


def test_task_seed_reaches_a_task_that_takes_one_and_is_refused_where_it_would_do_nothing(tmp_path):
    assert task_from_config(TaskConfig(seed=7)).seed == 7
    assert task_from_config(TaskConfig(args={"seed": 7})).seed == 7
    with pytest.raises(ConfigError, match="task.args.seed .* and task.seed .* disagree"):
        task_from_config(TaskConfig(seed=3, args={"seed": 7}))
    path = str(_write(tmp_path / "eval.json", ORZ_EVAL))
    with pytest.raises(ConfigError, match="task.seed: math takes no seed"):
        task_from_config(TaskConfig(name="math", seed=3, args={"train_data": [path]}))


USER_TASK = '''
from dataclasses import dataclass


def score(item):
    return float(item["completion"].strip() == item["problem"]["answer"])


@dataclass
class Reverse:
    """Reverse a word: a user's task in one file."""

    words: tuple = ("abc", "pipeline")
    name: str = "reverse"
    reward_fn = staticmethod(score)

    def __post_init__(self):
        if not self.words:
            raise ValueError("words must not be empty")

    def train_problems(self):
        return [{"id": w, "answer": w[::-1]} for w in self.words]

    def eval_problems(self):
        return self.train_problems()[:1]

    def prompt(self, problem):
        return problem["id"] + "="
'''


def test_a_task_plugs_in_by_dotted_path_with_its_own_args(tmp_path, monkeypatch):
    """`task.name: module:Class` and `task.args` build a user's task with no registry and no TaskConfig field;
    mistakes name the key to change."""
    (tmp_path / "user_tasks.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: a\nmodel: {path: m}\ntask:\n  name: user_tasks:Reverse\n  args: {words: [xy, rl]}\n")
    task = task_from_config(load_config(recipe).task)
    assert task.name == "reverse" and [p["answer"] for p in task.train_problems()] == ["yx", "lr"]
    assert task.prompt(task.eval_problems()[0]) == "xy="
    with pytest.raises(ConfigError, match="task.args.*unexpected keyword argument 'colour'"):
        task_from_config(load_config(recipe, ["task.args.colour=red"]).task)
    with pytest.raises(ConfigError, match="task.args.*words must not be empty"):
        task_from_config(load_config(recipe, ["task.args.words=[]"]).task)
    with pytest.raises(ConfigError, match="task.name.*cannot load 'user_tasks:Nope'"):
        task_from_config(load_config(recipe, ["task.name=user_tasks:Nope"]).task)
    with pytest.raises(ConfigError, match="task.name.*package.module:Class"):
        load_config(recipe, ["task.name=user tasks"])
    # the actor's view: the same object, scored through the pool by its top-level reward function
    from pipelinerl.rewards import RewardPool

    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with RewardPool(1, 10.0) as pool:
        results = pool.score(task.reward_fn, [reward_item(p, p["answer"], "stop") for p in task.train_problems()])
    assert [r.reward for r in results] == [1.0, 1.0]


def test_draw_distinct_keeps_order_excludes_and_says_when_the_space_is_too_small():
    import random

    from pipelinerl.tasks.base import draw_distinct

    keys = draw_distinct(50, random.Random(0), lambda r: r.randrange(100), exclude=frozenset(range(10)))
    assert len(set(keys)) == 50 and not set(keys) & set(range(10))
    assert keys == draw_distinct(50, random.Random(0), lambda r: r.randrange(100), exclude=frozenset(range(10)))
    with pytest.raises(ValueError, match="cannot draw 11 distinct problems; lower num_train"):
        draw_distinct(11, random.Random(0), lambda r: r.randrange(10), hint="; lower num_train")


def test_stated_answer_reads_the_final_answer_line_as_written():
    from pipelinerl.tasks.base import stated_answer

    assert stated_answer("1 + 2 = 3\nanswer 0332\n") == "0332"  # leading zeros kept: scoring compares as written
    assert stated_answer("answer 12\nmore text") is None  # not the last line
    assert stated_answer("answer \nanswer") is None
    assert stated_answer("answer " + "9" * 40) is None  # a runaway string of digits is not an answer


def test_prompts_through_the_chat_template_as_one_user_turn_when_asked():
    from pipelinerl.models.tiny import build_char_tokenizer
    from pipelinerl.tasks.base import prompt_token_ids

    tok = build_char_tokenizer()
    assert prompt_token_ids(tok, "1+2=") == tok.encode("1+2=")
    with pytest.raises(ValueError, match="model.chat_template is true but the model's tokenizer has no chat template"):
        prompt_token_ids(tok, "1+2=", chat_template=True)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert tok.decode(prompt_token_ids(tok, "1+2=", chat_template=True)) == "<user>1+2=<assistant>"


def test_a_chat_template_that_would_do_nothing_is_refused_by_name(tmp_path):
    from pipelinerl.launch.preflight import preflight
    from pipelinerl.placement import NodeEnv

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: {{path: m, init: tiny, chat_template: true}}\n")
    with pytest.raises(ConfigError, match="model.chat_template: a tiny model's tokenizer has no chat template"):
        preflight(load_config(recipe), str(recipe), NodeEnv(), 0)
