"""Math word problems with LaTeX gold answers, from local JSON/JSONL files or the Hugging Face hub.

Every loader returns problems as {"id", "problem", "answer", "source"}, whatever the file looked like:
- Open-Reasoner-Zero eval files: a JSON list of {"prompt": [{"from": "user", "value": ...}], "final_answer": ...};
- Open-Reasoner-Zero training files: a JSON list of [{"from": "human", "value": ...},
  {"from": "assistant", "ground_truth": {"value": ...}}];
- plain records: {"problem" | "question" | "prompt": ..., "answer" | "final_answer" | "solution": ...}, where a
  solution's last \\boxed{} is the answer and a GSM8K-style "... #### 42" answer is cut to "42".
Hub datasets (MATH-500 is "HuggingFaceH4/MATH-500", AIME 2024 "HuggingFaceH4/aime_2024") need the optional
`datasets` package and a reachable hub; a "name:split" suffix picks the split (default: test, else train).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.plugins import REWARD_RULES
from pipelinerl.rewards.choice import is_choice_problem, score_choice
from pipelinerl.rewards.math import UNCLOSED_KEY, last_boxed
from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.base import hub_rows, json_records

ORZ_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>. "
    "User: You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{{}} tag.\n"
    "This is the problem:\n{problem}\nAssistant: <think>"
)
TEMPLATES = {
    "orz": ORZ_TEMPLATE,
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "plain": "{problem}",
}



def score_math_task(item: dict) -> RewardResult:
    """The math task's pool entry point: a multiple-choice problem (GPQA: `choices` and a gold letter among them) is
    scored by its letter, anything else by the rule the task chose (`reward_rule`, put on every problem when it is
    loaded)."""
    problem = item["problem"]
    if is_choice_problem(problem):
        return score_choice(item)
    return REWARD_RULES.get(problem.get("reward_rule", "math"))(item)


def _warmup() -> None:
    # every rule's warm-up, each once (math and orz share math-verify's): a cold worker's first sympy/ANTLR parse
    # takes over a second, which ORZ's 1 s limit would turn into a false 0
    for warmup in dict.fromkeys(getattr(fn, "warmup", None) for _, fn in REWARD_RULES.items()):
        if warmup is not None:
            warmup()


score_math_task.warmup = _warmup  # type: ignore[attr-defined]  # run by reward pool workers
_LOCAL_SUFFIXES = (".json", ".jsonl")


def _user_turn(turns: list) -> str | None:
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") in ("user", "human") and "value" in turn:
            return str(turn["value"])
    return None


def _gold_from_turns(turns: list) -> Any:
    for turn in turns:
        if isinstance(turn, dict) and isinstance(turn.get("ground_truth"), dict):
            return turn["ground_truth"].get("value")
    return None


def _problem_text(item: dict) -> str | None:
    for key in ("problem", "question"):
        if isinstance(item.get(key), str):
            return item[key]
    prompt = item.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _user_turn(prompt)
    return None


def _answer_text(item: dict) -> str | None:
    for key in ("final_answer", "answer", "gold", "ground_truth"):
        value = item.get(key)
        if value is not None and not isinstance(value, (dict, list)):
            text = str(value)
            return text.split("####")[-1].strip() if "####" in text else text.strip()
    if isinstance(item.get("solution"), str):
        return last_boxed(item["solution"])
    return None


def normalize(item: Any, index: int, source: str) -> dict:
    """One record in any supported format -> {"id", "problem", "answer", "source"}; ValueError names the record."""
    if isinstance(item, list):  # ORZ training format: [human turn, assistant turn with ground_truth]
        problem, answer = _user_turn(item), _gold_from_turns(item)
        answer = None if answer is None else str(answer).strip()
    elif isinstance(item, dict):
        problem, answer = _problem_text(item), _answer_text(item)
    else:
        problem = answer = None
    if not problem or answer is None or answer == "":
        raise ValueError(f"{source}: record {index} has no recognisable problem and answer (expected ORZ "
                         f"'prompt'/'final_answer' or 'problem'/'answer' fields): {str(item)[:200]}")
    item_id = item.get("id", item.get("unique_id")) if isinstance(item, dict) else None
    name = Path(source).stem if Path(source).suffix in _LOCAL_SUFFIXES else source
    out = {"id": str(item_id) if item_id is not None else f"{name}-{index}", "problem": problem,
           "answer": answer, "source": name}
    if isinstance(item, dict) and isinstance(item.get("choices"), dict):  # multiple choice (GPQA): letter -> text
        out["choices"] = {str(k): str(v) for k, v in item["choices"].items()}
    solution = _solution_from_turns(item) if isinstance(item, list) else None
    if solution:
        out["solution"] = solution
    return out


def _solution_from_turns(turns: list) -> str | None:
    """A worked solution in the assistant turn (`value` beside `ground_truth`), where a file has one: the
    supervised warm-up target of the CPU rehearsal's synthetic problems. ORZ's own files have none."""
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") == "assistant" and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def load_file(path: str | Path) -> list[dict]:
    """A JSON list, or JSON Lines (one record per line; also accepted under a .json name, as `datasets` writes)."""
    path = Path(path)
    records = json_records(path.read_text(encoding="utf-8"), str(path))
    return [normalize(item, i, str(path)) for i, item in enumerate(records)]


def load_hub(name: str, split: str | None = None) -> list[dict]:
    """A Hugging Face dataset by name; needs the optional `datasets` package and network access to the hub."""
    return [normalize(row, i, name) for i, row in enumerate(hub_rows(name, split))]


def load_problems(source: str) -> list[dict]:
    """A local file if `source` exists, else a hub dataset "name" or "name:split"."""
    if Path(source).exists():
        return load_file(source)
    if source.endswith(_LOCAL_SUFFIXES):
        raise FileNotFoundError(f"math data file {source!r} does not exist")
    name, _, split = source.partition(":")
    return load_hub(name, split or None)


@dataclass
class MathTask:
    """Math problems from `train_data` / `eval_data` sources, prompted with `template` ("orz", "boxed", "plain")
    and scored by `reward` ("math": last \\boxed{}; "orz": the ORZ rule; empty: orz for the orz template).
    `accept_unclosed_answer` (ORZ rules only) is put on every problem, so the scoring function in a pool worker
    sees it with the item (see `pipelinerl.rewards.math`)."""

    train_data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    template: str = "orz"
    reward: str = ""
    name: str = "math"
    accept_unclosed_answer: bool = False
    reward_fn: Callable[[dict], Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {self.template!r}")
        self.rule = self.reward or ("orz" if self.template == "orz" else "math")
        if not REWARD_RULES.knows(self.rule):
            raise ValueError(f"reward must be one of {REWARD_RULES.choices()}, got {self.reward!r}")
        if self.accept_unclosed_answer and self.rule == "math":
            raise ValueError("accept_unclosed_answer applies to the ORZ rules (orz, orz_exact); the math rule has no "
                             "<answer> block")
        self.reward_fn = score_math_task
        self._cache: dict[str, list[dict]] = {}

    def _load(self, sources: list[str]) -> list[dict]:
        out = []
        for source in sources:
            if source not in self._cache:
                options = {"reward_rule": self.rule, **({UNCLOSED_KEY: True} if self.accept_unclosed_answer else {})}
                self._cache[source] = [{**p, **options} for p in load_problems(source)]
            out.extend(self._cache[source])
        return out

    def target(self, problem: dict) -> str:
        """The supervised warm-up target: the problem's worked solution (files with one, such as the CPU
        rehearsal's synthetic problems), written after the prompt."""
        if "solution" not in problem:
            raise ValueError(f"problem {problem['id']} has no worked solution to warm up on (the assistant turn "
                             "of ORZ's training format may carry one in `value`); set model.warmup_steps=0")
        return problem["solution"]

    def train_problems(self) -> list[dict]:
        return self._load(self.train_data)

    def eval_problems(self) -> list[dict]:
        return self._load(self.eval_data)

    def prompt(self, problem: dict) -> str:
        return TEMPLATES[self.template].format(problem=problem["problem"])
