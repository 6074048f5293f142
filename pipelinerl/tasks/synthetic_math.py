"""Synthetic math word problems in Open-Reasoner-Zero's file formats, for the CPU rehearsal of the ORZ path.

`python -m pipelinerl.tasks.synthetic_math DIR` writes
- `DIR/train.json`: ORZ's training format, a JSON list of `[{"from": "human", "value": problem},
  {"from": "assistant", "value": worked solution, "ground_truth": {"value": answer}}]` (ORZ's own files have no
  `value` in the assistant turn; here it is the supervised warm-up target, so a tiny model learns ORZ's output
  format: reasoning, `</think>`, then `<answer> \\boxed{...} </answer>`);
- `DIR/eval/add.json`, `DIR/eval/sub.json`: ORZ's eval format (`{"prompt": [{"from": "user", "value": ...}],
  "final_answer": ...}`), one benchmark each;
- `DIR/eval/choice.json`: a multiple-choice benchmark in GPQA Diamond's shape (`choices` letter -> option, the
  answer a letter), never trained on.

Everything the real ORZ recipes do then runs on these files unchanged: the math task's loaders, ORZ's prompt
template, stop strings, the ORZ reward, per-benchmark evaluation. The problems use one-digit operands, which a
2-layer model can learn: the warm-up teaches the format and some of the facts, RL the rest.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kai", "Lea", "Max", "Nia",
         "Omar", "Pia", "Quin", "Rosa", "Sam", "Tess"]
OBJECTS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cups", "flowers"]


def _add(rng: random.Random) -> tuple[str, str, int]:
    name, obj, a, b = rng.choice(NAMES), rng.choice(OBJECTS), rng.randint(0, 9), rng.randint(0, 9)
    problem = f"{name} has {a} {obj} and finds {b} more. How many {obj} does {name} have now?"
    return problem, f" {name} has {a} {obj} and gets {b} more, so {a} + {b} = {a + b}.", a + b


def _sub(rng: random.Random) -> tuple[str, str, int]:
    name, other, obj = rng.choice(NAMES), rng.choice(NAMES), rng.choice(OBJECTS)
    a = rng.randint(1, 9)
    b = rng.randint(0, a)
    problem = f"{name} has {a} {obj} and gives {b} of them to {other}. How many {obj} does {name} have left?"
    return problem, f" {name} had {a} {obj} and gives away {b}, so {a} - {b} = {a - b}.", a - b


KINDS = {"add": _add, "sub": _sub}


def worked_solution(reasoning: str, answer: int) -> str:
    """What follows ORZ's prompt (which ends in `Assistant: <think>`): the reasoning, then the answer block."""
    return f"{reasoning} </think> <answer> The answer is \\boxed{{{answer}}}. </answer>"


def train_records(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        problem, reasoning, answer = KINDS[rng.choice(list(KINDS))](rng)
        records.append([{"from": "human", "value": problem},
                        {"from": "assistant", "value": worked_solution(reasoning, answer),
                         "ground_truth": {"value": str(answer)}}])
    return records


def eval_records(kind: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"from": "user", "value": problem}], "final_answer": str(answer)}
            for problem, _, answer in (KINDS[kind](rng) for _ in range(n))]


def choice_records(n: int, seed: int) -> list[dict]:
    """Multiple choice in GPQA Diamond's shape: the options in the text and in `choices`, the answer a letter."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        problem, _, answer = _add(rng)
        options = rng.sample([v for v in range(19) if v != answer], 3) + [answer]
        rng.shuffle(options)
        choices = {letter: str(v) for letter, v in zip("ABCD", options)}
        text = problem + "\n\n" + "\n".join(f"{k}. {v}" for k, v in choices.items())
        records.append({"prompt": [{"from": "user", "value": text}], "choices": choices,
                        "final_answer": "ABCD"[options.index(answer)]})
    return records


def write_synthetic_orz(out_dir: str | Path, num_train: int = 4000, num_eval: int = 100, num_choice: int = 40,
                        seed: int = 0) -> dict[str, Path]:
    """Write the training file and the eval benchmarks; returns {name: path}. Eval problems are drawn with other
    seeds than the training ones (the one-digit facts repeat, the wording, names and objects vary)."""
    out = Path(out_dir)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    files = {"train": out / "train.json"}
    files["train"].write_text(json.dumps(train_records(num_train, seed)))
    for i, kind in enumerate(KINDS):
        files[kind] = out / "eval" / f"{kind}.json"
        files[kind].write_text(json.dumps(eval_records(kind, num_eval, seed + 1000 + i), indent=0))
    files["choice"] = out / "eval" / "choice.json"
    files["choice"].write_text(json.dumps(choice_records(num_choice, seed + 2000), indent=0))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default="data/orz_synthetic")
    p.add_argument("--num-train", type=int, default=4000)
    p.add_argument("--num-eval", type=int, default=100, help="problems per arithmetic benchmark")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write_synthetic_orz(args.out_dir, args.num_train, args.num_eval, seed=args.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
