"""Logic and procedural reasoning through Reasoning Gym (`pip install -e ".[reasoning]"`, PyPI `reasoning-gym`),
the generators ProRL trains its logic puzzles on: one task over any mix of them, scored by the library's own
`score_answer`, offline.

    task:
      name: reasoning_gym
      args:
        datasets: {leg_counting: 2, basic_arithmetic: 1}   # name -> sampling weight (a list: equal weights)
        configs: {basic_arithmetic: {min_terms: 2, max_terms: 3}}   # each generator's own settings
        num_train: 5000
        num_eval: 200

Each generator's share of the training and held-out problems follows its weight. The held-out problems are drawn
first, from a seed of their own, and training problems that repeat a held-out question are left out, as the
built-in tasks do. Every problem carries its generator's name (`generator`, and `domain` unless a mix names the
domain). The answer is what follows the prompt's
"Answer:" up to the end of the line (`answer_format: line`, for small models), or the last <answer>...</answer>
block (`answer_format: tag`, Reasoning Gym's and ProRL's format). A score below 1 (partial credit: some generators
give it) is the reward; `correct` is 1 only for a full score.

All 106 generators of reasoning-gym 0.1.25 but `composite` (which takes a list of datasets: use `datasets:` here
instead) build and score offline; one that cannot be built is refused when the task is made, naming it.
"""

from __future__ import annotations

import json
import random
from functools import cache

from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.base import split_by_weight

ANSWER_FORMATS = ("line", "tag")
PROMPTS = {
    "line": "{question}\nAnswer:",
    "tag": "{question}\nPut your final answer within <answer> </answer> tags.",
}
NEEDS_OTHER_DATASETS = {"composite": "it mixes other datasets; list them under datasets: with their weights"}


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("the reasoning_gym task needs Reasoning Gym: pip install -e '.[reasoning]' (PyPI "
                          "reasoning-gym)") from None
    return reasoning_gym


@cache
def _dataset(name: str, config_json: str, size: int, seed: int):
    return _library().create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def extract(completion: str, answer_format: str) -> str | None:
    """The answer in a completion: the first line (`line`) or the last <answer> block (`tag`); None if none."""
    if answer_format == "tag":
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion, tag_name="answer")
    line = completion.strip().split("\n", 1)[0].strip()
    return line or None


def score_reasoning_gym(item: dict) -> RewardResult:
    """The reward workers' entry point: the generator's own `score_answer` on the extracted answer."""
    problem = item["problem"]
    answer = extract(item["completion"], problem["answer_format"])
    if answer is None:
        return RewardResult(0.0, {"correct": 0.0}, "no answer found")
    scorer = _dataset(problem["generator"], problem["config"], 1, 0)
    score = float(scorer.score_answer(answer, problem["entry"]))
    return RewardResult(score, {"correct": float(score >= 1.0)}, f"{problem['generator']}: {score:g}")


class ReasoningGymTask:
    """A mix of Reasoning Gym generators, each with a weight and settings of its own."""

    name = "reasoning_gym"
    reward_fn = staticmethod(score_reasoning_gym)

    def __init__(self, datasets: dict[str, float] | list[str], configs: dict[str, dict] | None = None,
                 num_train: int = 5000, num_eval: int = 200, seed: int = 0, answer_format: str = "line"):
        weights = {name: 1.0 for name in datasets} if isinstance(datasets, (list, tuple)) else dict(datasets)
        if not weights:
            raise ValueError("datasets must name at least one Reasoning Gym generator")
        bad = {n: w for n, w in weights.items() if not isinstance(w, (int, float)) or w <= 0}
        if bad:
            raise ValueError(f"datasets: every weight must be a number > 0, got {bad}")
        configs = dict(configs or {})
        stray = sorted(set(configs) - set(weights))
        if stray:
            raise ValueError(f"configs for {stray}, which datasets does not name")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
        if num_train < 1 or num_eval < 0:
            raise ValueError("num_train must be >= 1 and num_eval >= 0")
        library = _library()
        known = set(library.factory.DATASETS)
        for name in weights:
            if name in NEEDS_OTHER_DATASETS:
                raise ValueError(f"datasets: {name!r} cannot be used here: {NEEDS_OTHER_DATASETS[name]}")
            if name not in known:
                near = sorted(k for k in known if name.split("_")[0] in k)[:8]
                raise ValueError(f"datasets: {name!r} is not a Reasoning Gym generator"
                                 + (f" (similar: {', '.join(near)})" if near else ""))
        self.weights, self.answer_format, self.seed = weights, answer_format, seed
        self.configs = {name: json.dumps(configs.get(name, {}), sort_keys=True) for name in weights}
        for name in weights:  # a generator or setting that cannot work is refused now, naming it
            try:
                _dataset(name, self.configs[name], 1, seed)[0]
            except Exception as e:  # noqa: BLE001 (generators raise what they raise)
                raise ValueError(f"{name} with settings {self.configs[name]} cannot make problems here: "
                                 f"{type(e).__name__}: {e}") from None
        self.num_train, self.num_eval = num_train, num_eval
        self._train: list[dict] | None = None
        self._eval: list[dict] | None = None

    def _problems(self, name: str, count: int, seed: int, split: str, skip: set[str]) -> list[dict]:
        ds = _dataset(name, self.configs[name], count + len(skip) + 16, seed)
        out = []
        for index in range(len(ds)):
            entry = ds[index]
            if entry["question"] in skip:
                continue
            out.append({"id": f"{name}-{split}-{index}", "problem": entry["question"], "answer": str(entry["answer"]),
                        "generator": name, "domain": name, "config": self.configs[name],
                        "answer_format": self.answer_format,
                        "entry": json.loads(json.dumps(entry, default=str))})
            if len(out) == count:
                break
        return out

    def _build(self) -> None:
        if self._eval is not None:
            return
        rng = random.Random(self.seed)
        eval_seed, train_seed = rng.randrange(2**31), rng.randrange(2**31)
        evals, trains = [], []
        eval_counts = split_by_weight(self.weights, self.num_eval)
        train_counts = split_by_weight(self.weights, self.num_train)
        for i, name in enumerate(sorted(self.weights)):
            held_out = self._problems(name, eval_counts[name], eval_seed + i, "eval", set())
            evals += held_out
            trains += self._problems(name, train_counts[name], train_seed + i, "train",
                                     {p["problem"] for p in held_out})
        random.Random(self.seed + 1).shuffle(trains)
        self._train, self._eval = trains, evals

    def train_problems(self) -> list[dict]:
        self._build()
        return self._train  # type: ignore[return-value]

    def eval_problems(self) -> list[dict]:
        self._build()
        return self._eval  # type: ignore[return-value]

    def prompt(self, problem: dict) -> str:
        return PROMPTS[self.answer_format].format(question=problem["problem"])

    def target(self, problem: dict, eos: str = "") -> str:
        """The generator's own answer in the prompt's answer format (a tiny model's supervised warm-up)."""
        answer = problem["answer"]
        return (f" {answer}" if self.answer_format == "line" else f"<answer>{answer}</answer>") + eos

    def domains(self) -> dict[str, float]:
        """The generators and their weights, for per-domain reports."""
        return dict(self.weights)

