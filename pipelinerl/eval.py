"""Evaluation harness: pass@1 (averaged over k samples) and pass@k of a model served by any engine.

`pipelinerl eval --model PATH --task arithmetic` starts an embedded engine for the model, or talks to a running
engine of any kind with `--engine-url`. Datasets: the project's tasks, local JSON/JSONL files (including the
Open-Reasoner-Zero eval format) and Hugging Face datasets by name where a hub is reachable (`--data`).
The trainer calls `evaluate` every `trainer.eval_every` steps on the held-out set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from pipelinerl.contracts.inference import GenerateRequest, SamplingParams
from pipelinerl.engines.client import AsyncEngineClient
from pipelinerl.rewards import RewardPool
from pipelinerl.tasks import Task, reward_item


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


async def evaluate_async(task: Task, problems: list[dict], engine_urls: list[str], tokenizer, pool: RewardPool,
                         k: int = 4, temperature: float = 1.0, max_new_tokens: int = 64,
                         concurrency: int = 64, greedy: bool = False, seed: int | None = 0) -> dict:
    """Score k samples per problem (1 greedy sample with `greedy`); returns summary metrics and per-problem rows."""
    engines = [AsyncEngineClient(u) for u in engine_urls]
    sem = asyncio.Semaphore(concurrency)
    n = 1 if greedy else k

    async def one(index: int, problem: dict) -> dict:
        ids = tokenizer.encode(task.prompt(problem))
        # Seeded per problem, so evaluations of different checkpoints draw comparable samples.
        req = GenerateRequest(prompt_token_ids=ids, sampling=SamplingParams(
            temperature=0.0 if greedy else temperature, max_new_tokens=max_new_tokens, n=n,
            seed=None if seed is None else seed + 1000 * index))
        async with sem:
            resp = await min(engines, key=lambda e: e.in_flight).generate(req)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in resp.completions]
        results = await pool.score_async(task.reward_fn, [reward_item(problem, t, c.finish_reason)
                                                          for t, c in zip(texts, resp.completions)])
        correct = [float(r.parts.get("correct", r.reward > 0)) for r in results]
        return {"id": problem.get("id"), "correct": correct, "sample": texts[0][:200],
                "version": resp.completions[0].versions[0] if resp.completions[0].versions else None}

    try:
        rows = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    finally:
        for e in engines:
            await e.aclose()
    return summarize(rows, n)


def summarize(rows: list[dict], n: int) -> dict:
    m = max(1, len(rows))
    summary = {"problems": len(rows), "samples_per_problem": n,
               "pass@1": sum(sum(r["correct"]) / n for r in rows) / m}
    for k in sorted({1, 2, 4, 8, 16, n}):
        if k <= n:
            summary[f"pass@{k}"] = sum(pass_at_k(n, int(sum(r["correct"])), k) for r in rows) / m
    return {"summary": summary, "rows": rows}


def write_results(result: dict, out_dir: Path, name: str = "eval") -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    lines = ["| metric | value |", "| --- | --- |"] + [
        f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |" for key, value in s.items()]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def _load_problems(args: argparse.Namespace) -> tuple[Task, list[dict]]:
    from pipelinerl.tasks import get_task

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
    p.add_argument("--template", default="orz", choices=["orz", "boxed", "plain"], help="prompt template for --data")
    p.add_argument("--digits", type=int, default=2, help="arithmetic operand digits")
    p.add_argument("--ops", default="+", help="arithmetic operators")
    p.add_argument("--reverse", action="store_true", help="arithmetic answers least significant digit first")
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--num-problems", type=int, default=200)
    p.add_argument("-k", type=int, default=4, help="samples per problem for pass@1 / pass@k")
    p.add_argument("--greedy", action="store_true", help="one greedy sample per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default=None, help="directory for eval.json and eval.md (default: the model directory)")


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pipelinerl.engines.client import EngineClient
    from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    task, problems = _load_problems(args)
    out_dir = Path(args.out or args.model)
    proc = None
    urls = args.engine_url
    if not urls:
        port = free_port()
        log = out_dir / "eval-engine.log"
        proc = start_process(engine_command(args.model, port, extra=["--max-model-len", str(args.max_model_len)]),
                             log)
        urls = [f"http://127.0.0.1:{port}"]
        try:
            EngineClient(urls[0]).wait_healthy(300, process=proc)
        except (RuntimeError, TimeoutError) as e:
            print(f"pipelinerl eval: {e}\n{tail(log)}", file=sys.stderr)
            stop_process(proc)
            return 1
    try:
        start = time.monotonic()
        with RewardPool(workers=1, timeout_s=10) as pool:
            result = asyncio.run(evaluate_async(task, problems, urls, tokenizer, pool, k=args.k,
                                                temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                                greedy=args.greedy))
        result["summary"]["seconds"] = round(time.monotonic() - start, 2)
    finally:
        if proc is not None:
            stop_process(proc)
    paths = write_results(result, out_dir)
    print(paths[1].read_text(), end="")
    print(f"results in {paths[0]} and {paths[1]}")
    return 0
