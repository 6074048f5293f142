"""Instruction following, IFEval-style: prompts with verifiable constraints, scored by IFEval's own checkers
(`pipelinerl.rewards.ifeval`, lm-eval's instruction registry; `pip install -e ".[ifeval]"`).

    task:
      name: ifeval
      args:
        eval_data: data/ifeval/input_data.jsonl   # IFEval's 541 prompts, when you have the file (else generated)
        num_train: 5000       # generated training prompts: a request plus 1..max_instructions constraints
        num_eval: 200         # generated held-out prompts, drawn first and never trained on (without eval_data)
        max_instructions: 2
        instructions: [punctuation:no_comma, startend:quotation]   # which constraints to draw (default: all)
        reward: all           # 1 when every constraint is followed (strict); `fraction`: the share followed

`train_data` / `eval_data` take IFEval's JSONL (`key, prompt, instruction_id_list, kwargs`), so the published prompts
(`google/IFEval` on the Hugging Face hub: `input_data.jsonl`) work as they are. The held-out evaluation reports
IFEval's four numbers per benchmark: prompt-level and instruction-level accuracy, strict and loose.

The generator writes a request from a topic and asks for constraints drawn from IFEval's registry with arguments
drawn from a seeded stream, their wording the checker's own `build_description`; pairs IFEval lists as
conflicting are never asked together. `target(problem)` writes a response that follows the constraints it can
construct (for a tiny model's supervised warm-up) and is checked by the same checkers.

An instruction whose checker cannot run here (NLTK's sentence model, missing offline) is refused when the task is
made, naming it; `unavailable: skip` leaves out the prompts that need it instead (and says how many), which makes
the numbers no longer comparable with IFEval's published ones.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path

from pipelinerl.rewards import ifeval as checks
from pipelinerl.tasks.base import draw_distinct, json_records

TOPICS = ("the sea", "a city at night", "bread", "rain", "a lighthouse", "winter", "a bicycle", "coffee", "the moon",
          "a garden", "trains", "an old map", "music", "a library", "mountains", "a river", "cats", "the desert",
          "a market", "friendship", "a storm", "clocks", "a forest", "paper", "the first snow", "a bridge", "bees",
          "a kitchen", "stars", "a harbour", "silence", "a letter", "apples", "the wind", "a museum", "islands")
REQUESTS = ("Write a short poem about {topic}.", "Write a few sentences about {topic}.",
            "Describe {topic} to a child.", "Write a short story about {topic}.", "Write a blog post about {topic}.",
            "Write an advertisement for {topic}.", "Explain why people like {topic}.", "Write a riddle about {topic}.")
WORDS = ("blue", "quiet", "river", "light", "stone", "green", "happy", "window", "morning", "gold", "small", "road")
ENDINGS = ("Any other questions?", "Is there anything else I can help with?", "That is all.")
# beyond IFEval's own conflicts: a postscript after the asked ending would end the response with something else
EXTRA_CONFLICTS = {("startend:end_checker", "detectable_content:postscript")}
UNAVAILABLE = ("error", "skip")
WRAPPERS = ("detectable_content:postscript", "startend:end_checker", "startend:quotation", "detectable_format:title")


def _draw_kwargs(instruction_id: str, rng: random.Random, request: str, taken: set[str]) -> dict:
    """The arguments of one constraint, drawn from `rng` (IFEval's kwargs names). Words already asked for or
    forbidden by another constraint of the prompt (`taken`, updated) are not drawn again, so no prompt asks for a
    word and forbids it."""
    relation = rng.choice(("less than", "at least"))

    def words(k: int) -> list[str]:
        drawn = rng.sample([w for w in WORDS if w not in taken], k)
        taken.update(drawn)
        return drawn

    draws = {
        "keywords:existence": lambda: {"keywords": words(rng.randint(1, 2))},
        "keywords:frequency": lambda: {"keyword": words(1)[0], "frequency": rng.randint(1, 3),
                                       "relation": relation},
        "keywords:forbidden_words": lambda: {"forbidden_words": words(rng.randint(1, 2))},
        "keywords:letter_frequency": lambda: {"letter": rng.choice("abcdefghijklmnoprstuw"),
                                              "let_frequency": rng.randint(1, 5), "let_relation": relation},
        "language:response_language": lambda: {"language": rng.choice(("en", "fr", "de", "es", "it"))},
        "length_constraints:number_sentences": lambda: {"num_sentences": rng.randint(1, 6), "relation": relation},
        "length_constraints:number_paragraphs": lambda: {"num_paragraphs": rng.randint(2, 4)},
        # "less than" from 20 words: a request with a keyword, an ending and a postscript can be answered in fewer
        "length_constraints:number_words": lambda: {"num_words": rng.choice(
            (5, 10, 20, 50, 100) if relation == "at least" else (20, 50, 100, 200)), "relation": relation},
        "length_constraints:nth_paragraph_first_word": lambda: _nth_paragraph(rng, words(1)[0]),
        "detectable_content:number_placeholders": lambda: {"num_placeholders": rng.randint(1, 3)},
        "detectable_content:postscript": lambda: {"postscript_marker": rng.choice(("P.S.", "P.P.S"))},
        "detectable_format:number_bullet_lists": lambda: {"num_bullets": rng.randint(2, 5)},
        "detectable_format:number_highlighted_sections": lambda: {"num_highlights": rng.randint(1, 3)},
        "detectable_format:multiple_sections": lambda: {"section_spliter": rng.choice(("Section", "SECTION")),
                                                        "num_sections": rng.randint(2, 4)},
        "combination:repeat_prompt": lambda: {"prompt_to_repeat": request},
        "startend:end_checker": lambda: {"end_phrase": rng.choice(ENDINGS)},
        "change_case:capital_word_frequency": lambda: {"capital_frequency": rng.randint(1, 4),
                                                       "capital_relation": relation},
    }
    return draws[instruction_id]() if instruction_id in draws else {}


def _nth_paragraph(rng: random.Random, first_word: str) -> dict:
    n = rng.randint(2, 4)
    return {"num_paragraphs": n, "nth_paragraph": rng.randint(1, n), "first_word": first_word}


def describe(instruction_id: str, kwargs: dict) -> str:
    """The constraint in IFEval's words (the checker's own `build_description`)."""
    checker = checks.registry()[instruction_id](instruction_id)
    state = random.getstate()
    try:
        random.seed(0)  # every argument is given; the seed only keeps `random` of the caller's stream untouched
        return checker.build_description(**kwargs)
    finally:
        random.setstate(state)


def _compatible(chosen: list[str], candidate: str) -> bool:
    table = checks.conflicts()
    return all(candidate not in table.get(c, ()) and c not in table.get(candidate, ())
               and (c, candidate) not in EXTRA_CONFLICTS and (candidate, c) not in EXTRA_CONFLICTS for c in chosen)


def read_ifeval_jsonl(path: str | Path) -> list[dict]:
    """IFEval's input records (`key, prompt, instruction_id_list, kwargs`) from a JSON or JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (IFEval's prompts: input_data.jsonl of google/IFEval on the "
                                "Hugging Face hub)")
    out = []
    for i, record in enumerate(json_records(path.read_text(), str(path))):
        missing = {"prompt", "instruction_id_list", "kwargs"} - set(record)
        if missing:
            raise ValueError(f"{path}: record {i} lacks {sorted(missing)} (IFEval's fields: key, prompt, "
                             "instruction_id_list, kwargs)")
        if len(record["kwargs"]) != len(record["instruction_id_list"]):
            raise ValueError(f"{path}: record {i}: {len(record['instruction_id_list'])} instructions but "
                             f"{len(record['kwargs'])} kwargs")
        unknown = sorted(set(record["instruction_id_list"]) - set(checks.registry()))
        if unknown:
            raise ValueError(f"{path}: record {i}: unknown instructions {unknown}")
        # IFEval's file writes every argument of every checker, unused ones as null: the checkers take only theirs
        kwargs = [{k: v for k, v in (kw or {}).items() if v is not None} for kw in record["kwargs"]]
        out.append({"id": f"ifeval-{record.get('key', i)}", "key": record.get("key", i), "prompt": record["prompt"],
                    "instruction_id_list": list(record["instruction_id_list"]), "kwargs": kwargs})
    return out


class IFEvalTask:
    """Prompts with verifiable constraints; IFEval's checkers as the verifier."""

    name = "ifeval"
    reward_fn = staticmethod(checks.score_ifeval)
    eval_ratios = checks.EVAL_RATIOS

    def __init__(self, train_data: str | None = None, eval_data: str | None = None, num_train: int = 5000,
                 num_eval: int = 200, max_instructions: int = 2, instructions: list[str] | None = None,
                 reward: str = "all", unavailable: str = "error", seed: int = 0):
        if reward not in checks.REWARDS:
            raise ValueError(f"reward must be one of {', '.join(checks.REWARDS)}, got {reward!r}")
        if unavailable not in UNAVAILABLE:
            raise ValueError(f"unavailable must be one of {', '.join(UNAVAILABLE)}, got {unavailable!r}")
        if max_instructions < 1:
            raise ValueError(f"max_instructions must be >= 1, got {max_instructions}")
        if num_train < 1 or num_eval < 0:
            raise ValueError("num_train must be >= 1 and num_eval >= 0")
        known = checks.registry()
        # repeat_prompt and two_responses ask for a copy of the request or two answers: kept for IFEval's own
        # prompts, not drawn by the generator unless named
        drawn = list(instructions) if instructions else [i for i in known if i not in (
            "combination:repeat_prompt", "combination:two_responses")]
        unknown = sorted(set(drawn) - set(known))
        if unknown:
            raise ValueError(f"instructions: unknown {unknown}; IFEval's are {', '.join(known)}")
        self.unavailable = unavailable
        self.missing = checks.unavailable_instructions()
        if instructions:
            self._refuse_unavailable(drawn, "instructions")
        else:
            drawn = [i for i in drawn if i not in self.missing]
        self.instructions, self.max_instructions, self.reward, self.seed = drawn, max_instructions, reward, seed
        self.num_train, self.num_eval = num_train, num_eval
        self.train_data, self.eval_data = train_data, eval_data
        self._train: list[dict] | None = None
        self._eval: list[dict] | None = None
        if eval_data is not None:  # read now: a wrong file or an unscorable prompt is said when the run starts
            self._eval = self._usable(read_ifeval_jsonl(eval_data), "eval_data")

    def _refuse_unavailable(self, ids: list[str], where: str) -> None:
        missing = sorted({i for i in ids if i in self.missing})
        if missing:
            raise ValueError(f"{where}: cannot check {', '.join(missing)} on this machine: {checks.NLTK_HINT}; "
                             "or set task.args.unavailable: skip to leave those prompts out")

    def _usable(self, problems: list[dict], where: str) -> list[dict]:
        needing = [p for p in problems if any(i in self.missing for i in p["instruction_id_list"])]
        if needing and self.unavailable == "error":
            self._refuse_unavailable([i for p in needing for i in p["instruction_id_list"]], where)
        if needing:
            warnings.warn(f"{where}: left out {len(needing)} of {len(problems)} prompts whose checkers cannot run "
                          "here (task.args.unavailable: skip); the scores are not comparable with IFEval's",
                          stacklevel=2)
        return [{**p, "reward": self.reward} for p in problems if p not in needing]

    def _generate(self, rng: random.Random) -> tuple:
        """One generated prompt as a hashable key: (request, ((id, kwargs json), ...))."""
        request = rng.choice(REQUESTS).format(topic=rng.choice(TOPICS))
        chosen: list[str] = []
        for _ in range(rng.randint(1, self.max_instructions)):
            options = [i for i in self.instructions if i not in chosen and _compatible(chosen, i)]
            if not options:
                break
            chosen.append(rng.choice(options))
        taken: set[str] = set()
        return request, tuple((i, json.dumps(_draw_kwargs(i, rng, request, taken), sort_keys=True)) for i in chosen)

    def _problem(self, key: tuple, split: str, index: int) -> dict:
        request, constraints = key
        ids = [i for i, _ in constraints]
        kwargs = [json.loads(k) for _, k in constraints]
        prompt = " ".join([request, *(describe(i, kw) for i, kw in zip(ids, kwargs))])
        return {"id": f"ifeval-{split}-{index}", "key": index, "prompt": prompt, "request": request,
                "instruction_id_list": ids, "kwargs": kwargs, "reward": self.reward}

    def _build(self) -> None:
        if self._train is not None:
            return
        rng = random.Random(self.seed)
        eval_rng, train_rng = random.Random(rng.randrange(2**31)), random.Random(rng.randrange(2**31))
        held_out_keys: frozenset = frozenset()
        if self._eval is None:
            keys = draw_distinct(self.num_eval, eval_rng, self._generate, hint=" (ifeval held-out prompts)")
            self._eval = [self._problem(k, "eval", i) for i, k in enumerate(keys)]
            held_out_keys = frozenset(keys)
        if self.train_data is not None:
            self._train = self._usable(read_ifeval_jsonl(self.train_data), "train_data")
        else:  # never a held-out prompt, generated (by its key) or from IFEval's file (by its text)
            held_out = frozenset(p["prompt"] for p in self._eval)
            keys = draw_distinct(self.num_train, train_rng, self._generate, exclude=held_out_keys,
                                 hint=" (ifeval training prompts)")
            problems = [self._problem(k, "train", i) for i, k in enumerate(keys)]
            self._train = [p for p in problems if p["prompt"] not in held_out]

    def train_problems(self) -> list[dict]:
        self._build()
        return self._train  # type: ignore[return-value]

    def eval_problems(self) -> list[dict]:
        self._build()
        return self._eval  # type: ignore[return-value]

    def prompt(self, problem: dict) -> str:
        return problem["prompt"] + "\n"

    def target(self, problem: dict, eos: str = "") -> str:
        """A response to a generated prompt that follows the constraints this can write (keywords, forbidden words,
        no commas, case, word counts, postscript, ending, quotation, title); others are left unmet."""
        topic = next((t for t in TOPICS if t in problem.get("request", "")), "it")
        text = f"i like {topic}"
        asked = dict(zip(problem["instruction_id_list"], problem["kwargs"]))
        for instruction_id in sorted(asked, key=lambda i: i == "length_constraints:number_words"):  # length last
            text = _apply(instruction_id, asked[instruction_id], text)
        for instruction_id in WRAPPERS:  # the wrappers last, innermost first, whatever order they were asked in
            if instruction_id in asked:
                text = _wrap(instruction_id, asked[instruction_id], text)
        return text + eos


def _apply(instruction_id: str, kw: dict, text: str) -> str:
    if instruction_id == "keywords:existence":
        return f"{text} {' '.join(kw['keywords'])}"
    if instruction_id == "keywords:frequency" and kw["relation"] == "at least":
        return f"{text}{(' ' + kw['keyword']) * kw['frequency']}"
    if instruction_id == "keywords:forbidden_words":
        for word in kw["forbidden_words"]:
            text = re.sub(r"\b" + re.escape(word) + r"\b", "", text, flags=re.I)
        return " ".join(text.split())
    if instruction_id == "length_constraints:number_words":
        words = text.split()
        if kw["relation"] == "at least":
            words += ["and"] * max(0, kw["num_words"] - len(words))
        else:
            words = words[:max(1, kw["num_words"] - 1)]
        return " ".join(words)
    if instruction_id == "change_case:english_lowercase":
        return text.lower()
    if instruction_id == "change_case:english_capital":
        return text.upper()
    if instruction_id == "punctuation:no_comma":
        return text.replace(",", "")
    return text


def _wrap(instruction_id: str, kw: dict, text: str) -> str:
    if instruction_id == "detectable_content:postscript":
        return f"{text}\n{kw['postscript_marker']} see you"
    if instruction_id == "startend:end_checker":
        return f"{text} {kw['end_phrase']}"
    if instruction_id == "startend:quotation":
        return f'"{text}"'
    if instruction_id == "detectable_format:title":
        return f"<<{text.split()[0] if text.split() else 'title'}>>\n{text}"
    return text
