"""STEM multiple choice: any number of options, shuffled per problem with the gold letter tracked, from the common
JSON layouts, scored by the letter the reply picks (`rewards.choice.score_multiple_choice`).

    task:
      name: multiple_choice
      args:
        train_data: data/sciq/train.json
        eval_data: [data/gpqa/gpqa_diamond.json, data/mmlu_pro/test.jsonl]   # one benchmark per file
        shuffle: true      # options in a seeded order of their own per problem (off: as the file has them)
        num_train: null    # all (else the first N after a seeded shuffle)

Records may be (JSON list or JSON Lines; the layout is found per record):
- MMLU-Pro: `question`, `options` (a list), `answer` (the letter) or `answer_index`;
- GPQA: `Question`, `Correct Answer`, `Incorrect Answer 1..3`;
- SciQ: `question`, `correct_answer`, `distractor1..3`;
- any other: `question` (or `problem`), `choices` (a list, or letter -> text) and `answer` (a letter, an index, or
  the gold option's text).

The prompt lists the options as "A. ..." lines and asks for "Answer: X"; the reply's letter is read from the last
\\boxed{}, else the last stated answer ("Answer: B", "the answer is (B)"), else a reply that is a letter alone or a
letter and its text ("(B)", "B.", "B) 5 m/s"), else an option's exact text.
"""

from __future__ import annotations

import hashlib
import random
import string
from pathlib import Path

from pipelinerl.rewards.choice import score_multiple_choice
from pipelinerl.tasks.base import json_records

LETTERS = string.ascii_uppercase
PROMPT = "{question}\n\n{options}\n\nAnswer with the letter of the correct option, as 'Answer: X'.\n"


def _options_and_gold(record: dict, where: str) -> tuple[str, list[str], int]:
    """(question, options, index of the gold option) of one record in any of the layouts above."""
    if "Correct Answer" in record:  # GPQA
        wrong = [record[k] for k in sorted(record) if k.startswith("Incorrect Answer") and record[k] is not None]
        return record["Question"], [record["Correct Answer"], *wrong], 0
    if "correct_answer" in record:  # SciQ
        wrong = [record[k] for k in sorted(record) if k.startswith("distractor") and record[k] is not None]
        return record["question"], [record["correct_answer"], *wrong], 0
    question = record.get("question", record.get("problem"))
    options = record.get("options", record.get("choices"))
    if question is None or options is None:
        raise ValueError(f"{where}: no question and options (MMLU-Pro's question/options/answer, GPQA's Question/"
                         "Correct Answer/Incorrect Answer N, SciQ's question/correct_answer/distractorN, or "
                         "question/choices/answer)")
    if isinstance(options, dict):
        keys = list(options)
        options = [options[k] for k in keys]
    else:
        keys = list(LETTERS[:len(options)])
    answer = record.get("answer", record.get("answer_index"))
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(options):
        gold = answer
    elif str(answer).strip() in keys:
        gold = keys.index(str(answer).strip())
    elif str(answer).strip() in [str(o).strip() for o in options]:
        gold = [str(o).strip() for o in options].index(str(answer).strip())
    else:
        raise ValueError(f"{where}: answer {answer!r} is neither a letter, an index nor an option's text")
    return question, [str(o) for o in options], gold


def read_choice_file(path: str | Path) -> list[dict]:
    """The records of a multiple-choice file as (question, options in the file's order, gold index) problems."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    out = []
    for i, record in enumerate(json_records(path.read_text(), str(path))):
        question, options, gold = _options_and_gold(record, f"{path}: record {i}")
        if not 2 <= len(options) <= len(LETTERS):
            raise ValueError(f"{path}: record {i} has {len(options)} options (2 to {len(LETTERS)} are possible)")
        out.append({"id": f"{path.stem}-{record.get('question_id', record.get('id', i))}", "question": question,
                    "options": options, "gold": gold, "source": path.stem})
    return out


class MultipleChoiceTask:
    """Multiple-choice questions; the reward is 1 when the reply picks the gold option."""

    name = "multiple_choice"
    reward_fn = staticmethod(score_multiple_choice)

    def __init__(self, train_data: str | list[str] | None = None, eval_data: str | list[str] | None = None,
                 shuffle: bool = True, num_train: int | None = None, seed: int = 0):
        if train_data is None and eval_data is None:
            raise ValueError("train_data or eval_data must name a file (MMLU-Pro, GPQA, SciQ or question/choices/"
                             "answer JSON)")
        self.train_files = [train_data] if isinstance(train_data, str) else list(train_data or [])
        self.eval_files = [eval_data] if isinstance(eval_data, str) else list(eval_data or [])
        self.shuffle, self.num_train, self.seed = shuffle, num_train, seed
        self._train = [self._laid_out(p) for f in self.train_files for p in read_choice_file(f)]
        self._eval = [self._laid_out(p) for f in self.eval_files for p in read_choice_file(f)]
        held_out = {p["question"] for p in self._eval}
        self._train = [p for p in self._train if p["question"] not in held_out]  # never trained on
        random.Random(seed).shuffle(self._train)
        if num_train is not None:
            self._train = self._train[:num_train]

    def _laid_out(self, problem: dict) -> dict:
        """The options in this problem's own seeded order (a hash of its id and the task's seed, so a problem is
        laid out the same in every process and run), lettered, with the gold letter."""
        order = list(range(len(problem["options"])))
        if self.shuffle:
            digest = hashlib.sha256(f"{self.seed}:{problem['id']}".encode()).digest()
            random.Random(digest).shuffle(order)
        choices = {LETTERS[i]: problem["options"][j] for i, j in enumerate(order)}
        return {"id": problem["id"], "question": problem["question"], "choices": choices,
                "answer": LETTERS[order.index(problem["gold"])], "source": problem["source"]}

    def train_problems(self) -> list[dict]:
        return self._train

    def eval_problems(self) -> list[dict]:
        return self._eval

    def prompt(self, problem: dict) -> str:
        options = "\n".join(f"{letter}. {text}" for letter, text in problem["choices"].items())
        return PROMPT.format(question=problem["question"], options=options)

    def target(self, problem: dict, eos: str = "") -> str:
        return f"Answer: {problem['answer']}" + eos
