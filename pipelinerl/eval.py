"""Evaluation harness: per benchmark, avg@k (pass@1 averaged over k samples) and pass@k of a model served by any
engine, and their unweighted mean over benchmarks.

`pipelinerl eval --model PATH --task arithmetic` starts an embedded engine for the model, or talks to a running
engine of any kind with `--engine-url`. Datasets: the project's tasks, local JSON/JSONL files (including the
Open-Reasoner-Zero eval format) and Hugging Face datasets by name where a hub is reachable (`--data`).
A benchmark is the problems of one source (one eval file, or one hub dataset): ORZ reports each benchmark's
accuracy averaged over 16 samples, and `eval_accuracy` as the unweighted mean over benchmarks, so a 30-problem
AIME counts as much as the 500 problems of MATH-500. The trainer calls `evaluate_async` every
`trainer.eval_every` steps on the held-out set, with evaluation's own sampling settings (`eval:` in the config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from pathlib import Path

from pipelinerl.contracts.inference import GenerateRequest, GenerateResponse, SamplingParams
from pipelinerl.engines.client import AsyncEngineClient
from pipelinerl.rewards import RewardPool
from pipelinerl.tasks import Task, is_multi_turn, reward_item
from pipelinerl.tasks.base import problem_sampling, prompt_token_ids, reward_preload
from pipelinerl.tasks.workflow import RolloutEngine, run_episodes


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), the chance that
    k of the n samples drawn without replacement include a correct one. Computed as a product of k ratios
    (n-c-i)/(n-i), each in [0, 1], as the paper's numpy version does: the binomials themselves overflow floats for
    n in the hundreds. With fewer than k wrong samples every draw of k holds a correct one: 1."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def benchmark_of(problem: dict, task: Task) -> str:
    """The benchmark a held-out problem counts in: its source (an eval file, a hub dataset), else its domain, else
    the task."""
    return str(problem.get("source") or problem.get("domain") or task.name)


def benchmark_names(sources: list[str]) -> dict[str, str]:
    """Source -> benchmark name, usable inside a metric key: the eval file's stem as the loaders give it
    ("aime2024"), a hub dataset's name without its organisation ("HuggingFaceH4/MATH-500" -> "MATH-500"), or the
    full name where two sources would share one."""
    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "data"

    short = {s: clean(s.rsplit("/", 1)[-1]) for s in sources}
    taken = [short[s] for s in sources]
    return {s: short[s] if taken.count(short[s]) == 1 else clean(s) for s in sources}


async def evaluate_async(task: Task, problems: list[dict], engine_urls: list[str], tokenizer, pool: RewardPool,
                         k: int = 4, temperature: float = 1.0, max_new_tokens: int = 64, top_p: float = 1.0,
                         top_k: int = 0, stop: list[str] | None = None, concurrency: int = 64, greedy: bool = False,
                         seed: int | None = 0, max_model_len: int = 4096, chat_template: bool = False) -> dict:
    """Score k samples per problem (1 greedy sample with `greedy`); returns the summary (the mean over
    benchmarks), one entry per benchmark (problems grouped by their "source"), per-problem rows and the settings.
    A task with a `rollout` (multi-turn) runs its own loop, within `max_model_len` tokens per episode."""
    engines = [AsyncEngineClient(u) for u in engine_urls]
    gone: set[str] = set()
    sem = asyncio.Semaphore(concurrency)
    n = 1 if greedy else k
    stop = list(stop or [])
    # A task without sources (arithmetic) is one benchmark named after the task; one with domains (a mix, Reasoning
    # Gym's generators), one benchmark per domain.
    sources = list(dict.fromkeys(benchmark_of(p, task) for p in problems))
    names = benchmark_names(sources)
    # a task's own held-out numbers beyond avg@k (IFEval's prompt and instruction levels): the reward parts they sum
    ratios = dict(getattr(task, "eval_ratios", None) or {})
    ratio_parts = sorted({part for pair in ratios.values() for part in pair if part})

    async def generate(req: GenerateRequest) -> GenerateResponse:
        while True:  # an engine that cannot be reached is left out of this evaluation (a restarted one
            live = [e for e in engines if e.url not in gone]  # has not had the weights being evaluated)
            if not live:
                raise ConnectionError(f"no engine of {engine_urls} reachable for the evaluation")
            engine = min(live, key=lambda e: e.in_flight)
            try:
                return await engine.generate(req)
            except ConnectionError:
                gone.add(engine.url)

    async def one(index: int, problem: dict) -> dict:
        # Seeded per problem, so evaluations of different checkpoints draw comparable samples.
        own_max_new_tokens, own_stop = problem_sampling(problem, max_new_tokens, stop)  # a mix domain's own
        sampling = SamplingParams(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=top_k,
                                  max_new_tokens=own_max_new_tokens, n=n, stop=own_stop,
                                  seed=None if seed is None else seed + 1000 * index)
        async with sem:
            if is_multi_turn(task):  # a multi-turn task: n episodes of its own loop (pipelinerl.tasks.workflow)
                engine = RolloutEngine(generate, tokenizer, sampling, max_model_len)
                episodes = await run_episodes(task, problem, engine, n)
                outputs = [(e.output_token_ids, e.finish_reason, e.versions, {"turns": e.turns,
                                                                               "tool_calls": e.tool_calls, **e.info})
                           for e in episodes]
            else:
                ids = prompt_token_ids(tokenizer, task.prompt(problem), chat_template)
                resp = await generate(GenerateRequest(prompt_token_ids=ids, sampling=sampling))
                outputs = [(c.token_ids, c.finish_reason, c.versions, {}) for c in resp.completions]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _, _ in outputs]
        results = await pool.score_async(task.reward_fn, [reward_item(problem, t, finish, **extra)
                                                          for t, (_, finish, _, extra) in zip(texts, outputs)])
        correct = [float(r.parts.get("correct", r.reward > 0)) for r in results]
        versions = [v for v in outputs[0][2] if v >= 0]
        row = {"id": problem.get("id"), "benchmark": names[benchmark_of(problem, task)],
               "correct": correct, "tokens": [len(ids) for ids, _, _, _ in outputs],
               "truncated": [finish == "length" for _, finish, _, _ in outputs], "sample": texts[0][:200],
               "version": versions[0] if versions else None}
        parts = {part: sum(r.parts[part] for r in results) for part in ratio_parts
                 if all(part in r.parts for r in results)}
        if parts:  # summed over the n samples; a sample its verifier could not score leaves the row without them
            row["parts"] = parts
        return row

    try:
        rows = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    finally:
        for e in engines:
            await e.aclose()
    result = summarize(rows, n, ratios)
    result["settings"] = {"k": n, "greedy": greedy, "temperature": 0.0 if greedy else temperature, "top_p": top_p,
                          "top_k": top_k, "max_new_tokens": max_new_tokens, "stop": stop, "seed": seed}
    return result


def _scores(rows: list[dict], n: int) -> dict:
    m = max(1, len(rows))
    scores = {f"avg@{n}": sum(sum(r["correct"]) / n for r in rows) / m}
    for k in sorted({1, 2, 4, 8, 16, n}):
        if k <= n:
            scores[f"pass@{k}"] = sum(pass_at_k(n, int(sum(r["correct"])), k) for r in rows) / m
    return scores


def summarize(rows: list[dict], n: int, ratios: dict[str, tuple[str, str | None]] | None = None) -> dict:
    """Per benchmark (rows grouped by "benchmark", in order of appearance): avg@n = the mean over its problems of
    the fraction of n samples correct (pass@1 estimated from n samples, ORZ's "averaged over 16 responses"), and
    pass@j for j in 1, 2, 4, ... n. The summary holds the unweighted mean of each over benchmarks.

    `ratios` (a task's `eval_ratios`): name -> (numerator part, denominator part or None for one per sample); each
    is sum(numerator) / sum(denominator) over a benchmark's samples, reported for a benchmark whose every row has
    those parts (IFEval's instruction level pools its instructions this way)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("benchmark", "all"), []).append(r)
    benchmarks = []
    for name, group in groups.items():
        entry = {"benchmark": name, "problems": len(group), "k": n, **_scores(group, n)}
        tokens = [t for r in group for t in r.get("tokens", [])]
        if tokens:  # ORZ's curves show output length next to accuracy
            entry["mean_output_tokens"] = sum(tokens) / len(tokens)
            entry["truncated"] = sum(x for r in group for x in r.get("truncated", [])) / len(tokens)
        own = _ratios(group, n, ratios or {})
        if own:
            entry.update(own, ratios=list(own))
        benchmarks.append(entry)
    keys = list(_scores([], n))
    mean = {key: sum(b[key] for b in benchmarks) / max(1, len(benchmarks)) for key in keys}
    summary = {"problems": len(rows), "benchmarks": len(benchmarks), "samples_per_problem": n, **mean}
    return {"summary": summary, "benchmarks": benchmarks, "rows": rows}


def _ratios(group: list[dict], n: int, ratios: dict[str, tuple[str, str | None]]) -> dict[str, float]:
    out = {}
    for name, (numerator, denominator) in ratios.items():
        needed = [numerator] + ([denominator] if denominator else [])
        if not group or not all(p in r.get("parts", {}) for r in group for p in needed):
            continue
        total = sum(r["parts"][denominator] for r in group) if denominator else n * len(group)
        out[name] = sum(r["parts"][numerator] for r in group) / total if total else 0.0
    return out


def metrics_row(result: dict) -> dict:
    """The scalars a metrics row gets from an evaluation: `eval_accuracy` (avg@k, mean over benchmarks: what the
    launcher and plots read), `eval_pass@j` (means over benchmarks), and per benchmark `eval_<benchmark>_avg@<k>`
    and `eval_<benchmark>_pass@<k>`."""
    s = result["summary"]
    n = s["samples_per_problem"]
    row = {"eval_accuracy": s[f"avg@{n}"], **{f"eval_{k}": v for k, v in s.items() if k.startswith("pass@")}}
    for b in result.get("benchmarks", []):
        row[f"eval_{b['benchmark']}_avg@{n}"] = b[f"avg@{n}"]
        row[f"eval_{b['benchmark']}_pass@{n}"] = b[f"pass@{n}"]
        for name in b.get("ratios", ()):
            row[f"eval_{b['benchmark']}_{name}"] = b[name]
    return row


def markdown_table(result: dict) -> str:
    s = result["summary"]
    n = s["samples_per_problem"]
    lines = [f"| benchmark | problems | k | avg@{n} | pass@{n} |", "| --- | ---: | ---: | ---: | ---: |"]
    for b in result.get("benchmarks", []):
        lines.append(f"| {b['benchmark']} | {b['problems']} | {n} | {b[f'avg@{n}']:.4f} | {b[f'pass@{n}']:.4f} |")
    lines.append(f"| mean | {s['problems']} | {n} | {s[f'avg@{n}']:.4f} | {s[f'pass@{n}']:.4f} |")
    own = [b for b in result.get("benchmarks", []) if b.get("ratios")]
    names = list(dict.fromkeys(k for b in own for k in b["ratios"]))
    if own:  # the task's own numbers (IFEval's strict and loose levels), a table of their own
        lines += ["", "| benchmark | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
        lines += [f"| {b['benchmark']} | " + " | ".join(f"{b[k]:.4f}" if k in b else "" for k in names) + " |"
                  for b in own]
    notes = [f"avg@{n}: the fraction of the {n} samples per problem that are correct, averaged over problems; "
             "mean: unweighted over benchmarks."]
    settings = result.get("settings")
    if settings:
        notes.append("sampling: " + ", ".join(f"{k} {v}" for k, v in settings.items() if k != "k"))
    if "seconds" in s:
        notes.append(f"took {s['seconds']} s")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def write_results(result: dict, out_dir: Path, name: str = "eval") -> tuple[Path, Path]:
    """`<out_dir>/<name>.json` (everything, per-problem rows included) and `<name>.md` (the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown_table(result))
    return json_path, md_path


def _load_problems(args: argparse.Namespace) -> tuple[Task, list[dict]]:
    from pipelinerl.tasks import get_task

    if args.task:  # any task, as a recipe names it: `--task code --task-args '{"eval_data": ["humaneval"]}'`
        try:
            task_args = json.loads(args.task_args)
        except json.JSONDecodeError as e:
            raise SystemExit(f"pipelinerl eval: --task-args must be a JSON object: {e}") from None
        if not isinstance(task_args, dict):
            raise SystemExit("pipelinerl eval: --task-args must be a JSON object, e.g. '{\"eval_data\": [...]}'")
        try:
            task = get_task(args.task, **task_args)
            return task, task.eval_problems()
        except (KeyError, TypeError, ValueError, ImportError, OSError) as e:
            raise SystemExit(f"pipelinerl eval: --task {args.task}: {e}") from None
    if args.data:
        task = get_task("math", train_data=list(args.data), eval_data=list(args.data), template=args.template)
        return task, task.eval_problems()
    task = get_task("arithmetic", digits=args.digits, ops=args.ops, num_eval=args.num_problems,
                    num_train=1, seed=args.task_seed, reverse=args.reverse)
    return task, task.eval_problems()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model directory (its tokenizer is used too)")
    p.add_argument("--engine-url", action="append", default=None,
                   help="a running engine serving the model (repeatable); default: start an embedded one")
    p.add_argument("--data", action="append", default=None,
                   help="JSON/JSONL file (ORZ or plain format) or hub dataset name; default: the arithmetic task")
    p.add_argument("--task", default=None, help="a task by name (arithmetic, math, code) or 'package.module:Class', "
                   "built with --task-args; its held-out problems are evaluated (overrides --data)")
    p.add_argument("--task-args", default="{}", help="the task's arguments as a JSON object, as task.args in a recipe")
    p.add_argument("--reward-workers", type=int, default=1, help="processes scoring answers in parallel")
    p.add_argument("--reward-timeout", type=float, default=60.0, help="seconds one answer's check may take")
    p.add_argument("--template", default="orz", choices=["orz", "boxed", "plain"], help="prompt template for --data")
    p.add_argument("--digits", type=int, default=2, help="arithmetic operand digits")
    p.add_argument("--ops", default="+", help="arithmetic operators")
    p.add_argument("--reverse", action="store_true", help="arithmetic answers least significant digit first")
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--num-problems", type=int, default=200)
    p.add_argument("-k", type=int, default=4,
                   help="samples per problem for avg@k and pass@k (ORZ reports avg@16)")
    p.add_argument("--greedy", action="store_true", help="one greedy sample per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a string that ends a generation, kept in the output (repeatable); ORZ's are "
                        "'User:', 'Human:', 'Assistant:' and '</answer>'")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--chat-template", action="store_true",
                   help="prompt as one user turn of the tokenizer's chat template (as model.chat_template)")
    p.add_argument("--out", default=None, help="directory for eval.json and eval.md, one row per benchmark (each "
                   "--data source) and their mean (default: the model directory)")


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pipelinerl.cli_args import model_directory
    from pipelinerl.engines.client import EngineClient
    from pipelinerl.procs import engine_command, start_process, stop_process, tail, wait_for_port

    args.model = model_directory(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    task, problems = _load_problems(args)
    out_dir = Path(args.out or args.model)
    proc = None
    urls = args.engine_url
    if not urls:
        log, port_file = out_dir / "eval-engine.log", out_dir / "eval-engine.port"
        port_file.unlink(missing_ok=True)
        # port 0: the engine binds a free port itself and reports it, so no other process can take it first
        proc = start_process(engine_command(args.model, 0, extra=["--max-model-len", str(args.max_model_len),
                                                                  "--port-file", str(port_file)]), log)
        try:
            urls = [f"http://127.0.0.1:{wait_for_port(port_file, proc, 300)}"]
            EngineClient(urls[0]).wait_healthy(300, process=proc)
        except (RuntimeError, TimeoutError) as e:
            print(f"pipelinerl eval: {e}\n{tail(log)}", file=sys.stderr)
            stop_process(proc)
            return 1
    try:
        start = time.monotonic()
        with RewardPool(workers=args.reward_workers, timeout_s=args.reward_timeout,
                        preload=reward_preload(task)) as pool:
            result = asyncio.run(evaluate_async(task, problems, urls, tokenizer, pool, k=args.k,
                                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                max_new_tokens=args.max_new_tokens, stop=args.stop,
                                                greedy=args.greedy, max_model_len=args.max_model_len,
                                                chat_template=args.chat_template))
        result["summary"]["seconds"] = round(time.monotonic() - start, 2)
    finally:
        if proc is not None:
            stop_process(proc)
    paths = write_results(result, out_dir)
    print(paths[1].read_text(), end="")
    print(f"results in {paths[0]} and {paths[1]}")
    return 0
