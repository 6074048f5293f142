"""Every seam of pipelinerl.plugins proved from outside the package: a task, a reward rule, a policy loss and an
engine kind, each one file in a folder of their own, used by a recipe through its dotted path, without an edit to
the project; and the registries' own rules (names, paths, what an unknown name says)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.plugins import ENGINES, REWARD_RULES, TASKS, Registry, UnknownPlugin, is_dotted_path

ROOT = Path(__file__).resolve().parents[1]

TASK = '''
import random

from pipelinerl.tasks.base import reward_item  # noqa: F401 (what the actor builds a task's items with)


def score_copy(item):
    """1 for an output that starts with the prompt's letters, repeated."""
    return float(item["completion"].strip().startswith(item["problem"]["answer"]))


class CopyTask:
    """Repeat three letters: "abc=" -> "abc"."""

    name = "copy"
    reward_fn = staticmethod(score_copy)

    def __init__(self, num_train=200, seed=0):
        rng = random.Random(seed)
        words = ["".join(rng.choice("abcd") for _ in range(3)) for _ in range(num_train + 20)]
        self._train = [{"id": f"t{i}", "answer": w} for i, w in enumerate(words[:num_train])]
        self._eval = [{"id": f"e{i}", "answer": w} for i, w in enumerate(words[num_train:])]

    def train_problems(self):
        return self._train

    def eval_problems(self):
        return self._eval

    def prompt(self, problem):
        return problem["answer"] + "="
'''

LOSS = '''
from pipelinerl.rl.registry import register_policy_loss


@register_policy_loss("plain_pg_outside", clip=(0.2, 0.2), aggregation="token_mean", reads=())
def plain_pg(logprobs, inputs, cfg):
    """REINFORCE on the advantages, with a statistic of its own (which the trainer must log)."""
    loss = -(logprobs * inputs.advantages)
    return loss.where(inputs.mask, 0.0), {"outside_loss_calls": logprobs.new_ones(())}
'''

ENGINE = '''
import os
from pathlib import Path

from pipelinerl.contracts.engine import EngineKind


def serve(args):
    """The embedded engine, after leaving a mark that this kind served it."""
    from pipelinerl.engines.embedded.serve import serve as serve_embedded

    Path(os.environ["OUTSIDE_ENGINE_MARKS"], f"served-{os.getpid()}").write_text(args.model)
    serve_embedded(args)


KIND = EngineKind(name="outside", serve="outside_engine:serve")
'''

RULE = '''
def score_length(item):
    """A math reward rule of one's own: 1 for an output of at most 5 characters."""
    return float(len(item["completion"]) <= 5)
'''


def _write_plugins(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("outside_task", TASK), ("outside_loss", LOSS), ("outside_engine", ENGINE),
                       ("outside_rule", RULE)):
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    return folder


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_task_a_loss_and_an_engine_kind_from_outside_run_a_recipe(tmp_path):
    plugins, marks, run_dir = _write_plugins(tmp_path / "plugins"), tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    env = {**os.environ, "OUTSIDE_ENGINE_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pipelinerl.cli", "run", "recipes/tiny_cpu.yaml", f"run_dir={run_dir}",
           "task.name=outside_task:CopyTask", "task.args.num_train=100", "trainer.policy_loss=outside_loss:plain_pg",
           "engine.kind=outside_engine:KIND", "model.warmup_steps=0", "model.tiny_hidden_size=32",
           "trainer.max_steps=3", "trainer.samples_per_step=16", "trainer.eval_every=0",
           "actor.dynamic_sampling=false", "sampling.max_new_tokens=4"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(marks.glob("served-*"))) == 1  # the engine kind's own serve ran the one engine
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "samples" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r.get("outside_loss_calls") == 1.0 for r in steps), steps[-1]  # the loss's own statistic, logged
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)  # scored by the task's reward function


def test_a_reward_rule_from_outside_scores_the_math_task_in_the_workers(tmp_path, monkeypatch):
    from pipelinerl.rewards import RewardPool
    from pipelinerl.tasks import reward_item, task_from_config

    plugins = _write_plugins(tmp_path / "plugins")
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv("PYTHONPATH", str(plugins))  # the reward workers import the rule by its path
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused", "task.name=math",
                             f"task.args.train_data=[{data}]", "task.args.reward=outside_rule:score_length"])
    task = task_from_config(cfg.task)
    problem = task.train_problems()[0]
    with RewardPool(1, 10.0) as pool:
        results = pool.score(task.reward_fn, [reward_item(problem, "short", "stop"),
                                              reward_item(problem, "much too long", "stop")])
    assert [r.reward for r in results] == [1.0, 0.0]
    with pytest.raises(ConfigError, match="task.args: math refused .* reward must be one of math, orz, orz_exact"):
        task_from_config(load_config(None, [f"run_dir={tmp_path}", "model.path=unused", "task.name=math",
                                            f"task.args.train_data=[{data}]", "task.args.reward=length"]).task)


def test_registries_own_the_names_the_config_accepts():
    assert TASKS.names() == ["arithmetic", "code", "ifeval", "math", "mix", "multiple_choice", "reasoning_gym"]
    assert REWARD_RULES.names() == ["math", "orz", "orz_exact"]
    assert ENGINES.names() == ["embedded", "sglang", "vllm"]
    from pipelinerl.contracts.engine import engine_kind

    assert [engine_kind(n).name for n in ENGINES.names()] == ENGINES.names()  # each kind's object says its name
    with pytest.raises(ConfigError, match="engine.kind: must be one of embedded, sglang, vllm"):
        load_config(None, ["run_dir=x", "model.path=m", "engine.kind=tgi"])
    with pytest.raises(ConfigError, match="engine.kind: .*cannot import module 'nowhere'"):
        load_config(None, ["run_dir=x", "model.path=m", "engine.kind=nowhere:KIND"])
    with pytest.raises(ConfigError, match="engine.kind: .*not a pipelinerl.contracts.engine.EngineKind"):
        load_config(None, ["run_dir=x", "model.path=m", "engine.kind=os.path:join", "engine.tensor_parallel_size=2"])


def test_a_task_registered_at_run_time_is_one_the_config_accepts(monkeypatch):
    """config.TASKS once duplicated the task list: a task added with register_task() was refused by the config."""
    from pipelinerl.tasks import register_task

    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))
    with pytest.raises(ConfigError, match="task.name"):
        load_config(None, ["run_dir=x", "model.path=m", "task.name=sorting"])
    register_task("sorting", "my_tasks:Sorting")
    assert load_config(None, ["run_dir=x", "model.path=m", "task.name=sorting"]).task.name == "sorting"


def test_a_registry_imports_lazily_refuses_a_second_entry_and_says_what_exists():
    reg: Registry[object] = Registry("widget", {"json": "json:dumps"})
    assert "json" in reg and reg.knows("os.path:join") and not reg.knows("os path") and not reg.knows("nope")
    assert reg.get("json") is json.dumps and reg.get("os.path:join") is os.path.join
    reg.add("json", json.dumps)  # the same object again: fine
    with pytest.raises(ValueError, match="a widget named 'json' is already registered"):
        reg.add("json", json.loads)
    with pytest.raises(UnknownPlugin, match=r"unknown widget 'yaml'; registered: json \(or name your own"):
        reg.get("yaml")
    with pytest.raises(UnknownPlugin, match="widget 'json:nope': module 'json' has no 'nope'"):
        reg.get("json:nope")
    assert is_dotted_path("a.b:c") and not is_dotted_path("a.b") and not is_dotted_path("a b:c")
