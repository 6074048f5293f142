"""Several domains in one run: `task.name: mix`, each domain a task of its own (a built-in or a dotted path) with
a sampling weight and its own arguments.

    task:
      name: mix
      args:
        domains:
          arithmetic: {task: arithmetic, weight: 2, args: {digits: 2, ops: "+", reverse: true}}
          legs: {task: reasoning_gym, weight: 1, args: {datasets: [leg_counting]}}
          constraints: {task: ifeval, weight: 1, args: {max_instructions: 1}, sampling: {max_new_tokens: 48}}
          code: {task: code, weight: 1, args: {...}, reward_timeout_s: 30}
        num_train: 6000   # training problems in all, split by weight (default: the domains' own, summed)

Every problem carries its domain (`problem["domain"]`), so the trainer's metrics (`domain_<name>_*`) and the held-
out evaluation (one benchmark per domain, plus their mean) report each apart. Each domain keeps its own prompt and
its own verifier: the mix's reward function routes a problem to its domain's scoring function inside the reward
workers, with its domain's name on every result, bounded by its domain's `reward_timeout_s` where it has one (else
the run's `reward.timeout_s`: a slow verifier, sandboxed code, need not widen everyone's). A domain's `sampling`
(`max_new_tokens`, `stop`) replaces the run's for its problems, in training and in the held-out evaluation. A
domain's own held-out numbers (IFEval's strict and loose levels) are reported for its benchmark. The supervised
warm-up of a tiny model writes each domain's own targets (every domain's task must have them). Multi-turn tasks
cannot be mixed yet.
"""

from __future__ import annotations

import random
from typing import Any

from pipelinerl.plugins import TASKS, import_ref
from pipelinerl.rewards.pool import TIMEOUT_KEY, function_ref, to_result
from pipelinerl.rewards.result import RewardResult
from pipelinerl.tasks.base import SAMPLING_KEY, SAMPLING_OVERRIDES, is_multi_turn, split_by_weight

REWARD_KEY = "mix_reward_fn"  # the problem key naming its domain's scoring function ("module:function")


def score_mix(item: dict) -> RewardResult:
    """The reward workers' entry point: the problem's own domain's scoring function."""
    problem = item["problem"]
    result = to_result(import_ref(problem[REWARD_KEY], "mix domain's reward function")(item))
    return RewardResult(result.reward, result.parts, f"{problem['domain']}: {result.info}".rstrip(": "))


class MixTask:
    """Domains sampled by weight; problems tagged with their domain; prompts and verifiers kept per domain."""

    name = "mix"
    reward_fn = staticmethod(score_mix)

    def __init__(self, domains: dict[str, dict[str, Any]], num_train: int | None = None, seed: int = 0):
        if not domains:
            raise ValueError("domains must name at least one domain: {name: {task: ..., weight: ..., args: {...}}}")
        self.tasks, self.weights, self.reward_refs, self.sampling, self.timeouts = {}, {}, {}, {}, {}
        for name, spec in domains.items():
            unknown = set(spec) - {"task", "weight", "args", "sampling", TIMEOUT_KEY}
            if unknown or "task" not in spec:
                raise ValueError(f"domains.{name}: takes task (required), weight, args, sampling and "
                                 f"{TIMEOUT_KEY}, got {sorted(spec)}")
            timeout = spec.get(TIMEOUT_KEY)
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or timeout <= 0):
                raise ValueError(f"domains.{name}.{TIMEOUT_KEY} must be a number of seconds > 0, got {timeout!r}")
            if timeout is not None:
                self.timeouts[name] = float(timeout)
            sampling = dict(spec.get("sampling") or {})
            stray = sorted(set(sampling) - set(SAMPLING_OVERRIDES))
            if stray:
                raise ValueError(f"domains.{name}.sampling: takes {', '.join(SAMPLING_OVERRIDES)}, got {stray}")
            if "max_new_tokens" in sampling and (not isinstance(sampling["max_new_tokens"], int)
                                                 or sampling["max_new_tokens"] < 1):
                raise ValueError(f"domains.{name}.sampling.max_new_tokens must be an integer >= 1")
            if "stop" in sampling:
                sampling["stop"] = [sampling["stop"]] if isinstance(sampling["stop"], str) else list(sampling["stop"])
            weight = spec.get("weight", 1.0)
            if not isinstance(weight, (int, float)) or weight <= 0:
                raise ValueError(f"domains.{name}.weight must be a number > 0, got {weight!r}")
            if spec["task"] == "mix":
                raise ValueError(f"domains.{name}: a mix cannot hold another mix")
            try:
                task = TASKS.get(spec["task"])(**dict(spec.get("args") or {}))
            except (KeyError, TypeError, ValueError, OSError) as e:
                raise ValueError(f"domains.{name} ({spec['task']}): {e}") from None
            if is_multi_turn(task):
                raise ValueError(f"domains.{name}: {spec['task']} is multi-turn, which a mix cannot hold yet")
            # "module:function", what the workers import; a lambda or method cannot reach them: said now
            self.reward_refs[name] = function_ref(task.reward_fn)
            self.tasks[name], self.weights[name], self.sampling[name] = task, float(weight), sampling
        self.num_train, self.seed = num_train, seed
        # every domain's own held-out numbers; a benchmark reports those its rows carry
        self.eval_ratios = {k: v for task in self.tasks.values() for k, v in getattr(task, "eval_ratios", {}).items()}
        if all(callable(getattr(task, "target", None)) for task in self.tasks.values()):
            self.target = self._target  # the warm-up looks for `target`: only where every domain can write one
        self._train: list[dict] | None = None
        self._eval: list[dict] | None = None

    def _tagged(self, name: str, problem: dict, split: str, index: int) -> dict:
        tagged = {**problem, "id": f"{name}-{split}-{problem.get('id', index)}", "domain": name,
                  REWARD_KEY: self.reward_refs[name]}
        if self.sampling[name]:
            tagged[SAMPLING_KEY] = self.sampling[name]
        if name in self.timeouts:
            tagged[TIMEOUT_KEY] = self.timeouts[name]  # the reward pool bounds this problem's check by it
        return tagged

    def train_problems(self) -> list[dict]:
        """Each domain's share of the training problems by weight, its own problems repeated where it has fewer
        (a repeat keeps its id), interleaved in a seeded order."""
        if self._train is None:
            own = {name: task.train_problems() for name, task in self.tasks.items()}
            total = self.num_train or sum(len(p) for p in own.values())
            out = []
            for name, share in split_by_weight(self.weights, total).items():
                problems = own[name]
                if not problems:
                    raise ValueError(f"domains.{name}: its task has no training problems")
                out += [self._tagged(name, problems[i % len(problems)], "train", i % len(problems))
                        for i in range(share)]
            random.Random(self.seed).shuffle(out)
            self._train = out
        return self._train

    def eval_problems(self) -> list[dict]:
        """Every domain's held-out problems, whatever the weights: each domain is its own benchmark."""
        if self._eval is None:
            self._eval = [self._tagged(name, p, "eval", i) for name, task in self.tasks.items()
                          for i, p in enumerate(task.eval_problems())]
        return self._eval

    def prompt(self, problem: dict) -> str:
        return self.tasks[problem["domain"]].prompt(problem)

    def _target(self, problem: dict, *args: Any) -> str:
        return self.tasks[problem["domain"]].target(problem, *args)

    def domains(self) -> dict[str, float]:
        return dict(self.weights)
