"""What a task is: a dataset of prompts plus a verifier.

The actor needs four things from a task: the problems to train on, the held-out problems to evaluate on, the
text to feed the model for a problem, and a scoring function the reward pool can run in a worker process. The
scoring function is a top-level function (imported by module and name in the worker) taking the dict built by
`reward_item`; it returns a `RewardResult` (or a float, or `(float, parts)`) and puts 1/0 correctness in
`parts["correct"]`, which length shaping and accuracy metrics read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pipelinerl.tasks.workflow import Episode, RolloutEngine


@runtime_checkable
class Task(Protocol):
    name: str
    reward_fn: Callable[[dict], Any]

    def train_problems(self) -> list[dict]: ...

    def eval_problems(self) -> list[dict]: ...

    def prompt(self, problem: dict) -> str: ...


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task that drives the engine itself, turn by turn (tools, environments: tasks/workflow.py). The actor and
    the held-out evaluation run `group_size` (or eval_k) episodes of its `rollout` per problem instead of one
    generation of `prompt(problem)`; the episode's last text is scored with `reward_fn` as any task's."""

    async def rollout(self, engine: RolloutEngine, problem: dict) -> Episode: ...


# A problem's own sampling settings (a mix's domain with `sampling:`), which replace the run's `sampling.*` for it
SAMPLING_KEY = "sampling"
SAMPLING_OVERRIDES = ("max_new_tokens", "stop")


def problem_sampling(problem: dict, max_new_tokens: int, stop: list[str]) -> tuple[int, list[str]]:
    """The max_new_tokens and stop strings to sample `problem` with: its own where it has them, else the run's."""
    own = problem.get(SAMPLING_KEY) or {}
    return int(own.get("max_new_tokens", max_new_tokens)), list(own.get("stop", stop))


def is_multi_turn(task: Task) -> bool:
    """Whether the actor and evaluation run the task's own `rollout` instead of one generation per attempt."""
    return isinstance(task, MultiTurnTask)


def split_by_weight(weights: dict[str, float], total: int) -> dict[str, int]:
    """`total` split in proportion to `weights`, largest remainders first, so the counts add up to `total`; every
    name gets at least one while `total` is not 0."""
    norm = sum(weights.values())
    raw = {name: total * w / norm for name, w in weights.items()}
    counts = {name: int(r) for name, r in raw.items()}
    for name in sorted(raw, key=lambda n: raw[n] - counts[n], reverse=True)[:total - sum(counts.values())]:
        counts[name] += 1
    return {name: max(1, c) if total else 0 for name, c in counts.items()}


def draw_distinct(count: int, rng: random.Random, make_key: Callable[[random.Random], Hashable],
                  exclude: frozenset = frozenset(), hint: str = "") -> list:
    """`count` distinct keys drawn by `make_key(rng)` and not in `exclude`, in the order first drawn. Tasks draw
    their held-out set first, from a stream of its own, and the training set excluding it, so the held-out problems
    do not depend on num_train and are never trained on. Raises ValueError (with `hint`) when the draws keep
    repeating: the space is too small for `count`."""
    out: dict[Hashable, None] = {}
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 100 * count + 10_000:
            raise ValueError(f"cannot draw {count} distinct problems{hint}")
        key = make_key(rng)
        if key not in exclude:
            out[key] = None
    return list(out)


def prompt_token_ids(tokenizer: Any, text: str, chat_template: bool = False) -> list[int]:
    """The tokens a prompt is generated from: `text` as it is, or (`model.chat_template`) as one user turn of the
    tokenizer's chat template followed by its generation prompt."""
    if not chat_template:
        return tokenizer.encode(text)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("model.chat_template is true but the model's tokenizer has no chat template "
                         "(tokenizer_config.json): set model.chat_template=false to prompt with the raw text")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def reward_preload(task: Task) -> tuple[str, ...]:
    """The scoring functions ("module:function") a task's `reward_fn` calls in turn (a mix's domains), for the
    reward workers to import and warm up before their clock starts (`RewardPool(preload=...)`)."""
    return tuple(dict.fromkeys(getattr(task, "reward_refs", {}).values()))


def reward_item(problem: dict, completion: str, finish_reason: str, **extra: Any) -> dict:
    """The plain dict a task's `reward_fn` receives: picklable, so it can cross into a reward worker."""
    return {"problem": problem, "completion": completion, "finish_reason": finish_reason, **extra}


def hub_rows(name: str, split: str | None = None) -> list[dict]:
    """The rows of a Hugging Face dataset split (the "test" split, else "train", else the first, when not given):
    the tasks' loaders share it. Needs the optional `datasets` package and network access to the hub."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {name!r} from the Hugging Face hub needs the `datasets` package "
                          "(pip install datasets); or pass a local JSON/JSONL file instead") from None
    if split is None:
        splits = datasets.get_dataset_split_names(name)
        split = next((s for s in ("test", "train") if s in splits), splits[0])
    return [dict(row) for row in datasets.load_dataset(name, split=split)]


def json_records(text: str, source: str) -> list:
    """The records of a JSON list, a single JSON object, or JSON Lines (also under a .json name, as `datasets`
    writes them); `source` names the file in the error."""
    import json

    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: neither a JSON list nor JSON Lines: {e}") from None
    return [records] if isinstance(records, dict) else records


_ANSWER_LINE = re.compile(r"answer (\d{1,32})\s*$")  # capped: a runaway string of digits is wrong anyway


def stated_answer(completion: str) -> str | None:
    """The digits of a scratchpad task's final line ("answer 0332" -> "0332"), exactly as written, or None
    where the completion does not end with such a line."""
    m = _ANSWER_LINE.search(completion.strip()[-64:])
    return m.group(1) if m else None
