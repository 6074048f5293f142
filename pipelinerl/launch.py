"""The launcher role: `pipelinerl run RECIPE.yaml [overrides]`.

It resolves the config into the run directory, prepares the model, starts the engine processes and watches
them. What it runs after that is, for now, the in-flight smoke run below: the full actor / reward / trainer
pipeline is not built yet (see the project's issues), so the launcher plays the trainer's side of the weight
protocol itself and shows the part that exists working for real: engines generating while new weights arrive.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from pipelinerl.config import ConfigError, RunConfig, load_config, save_resolved_config
from pipelinerl.engines.client import EngineClient, init_group_on_engines, push_weights
from pipelinerl.procs import engine_command, start_process, stop_process, tail
from pipelinerl.weight_sync import init_weight_update_group


def prepare_model(cfg: RunConfig) -> Path:
    path = Path(cfg.model.path)
    if cfg.model.init == "tiny" and not (path / "config.json").exists():
        from pipelinerl.models.tiny import build_tiny_model

        print(f"building a tiny model in {path} (seed {cfg.seed})")
        build_tiny_model(path, hidden_size=cfg.model.tiny_hidden_size, num_layers=cfg.model.tiny_layers,
                         seed=cfg.seed, max_positions=max(1024, cfg.engine.max_model_len))
    return path


class Engines:
    """The engine child processes of a run; `check()` raises with the log tail if one died."""

    def __init__(self, cfg: RunConfig, model_path: Path, run_dir: Path):
        self.procs, self.clients, self.logs = [], [], []
        e = cfg.engine
        for i in range(e.num_engines):
            port = e.base_port + i
            log = run_dir / "logs" / f"engine{i}.log"
            extra = ["--max-running-seqs", str(e.max_running_seqs), "--max-batch-tokens", str(e.max_batch_tokens),
                     "--max-model-len", str(e.max_model_len), "--threads", str(e.threads),
                     "--dtype", cfg.model.dtype]
            self.procs.append(start_process(engine_command(str(model_path), port, e.host, e.kind, extra), log,
                                            threads=e.threads))
            self.clients.append(EngineClient(f"http://{e.host}:{port}"))
            self.logs.append(log)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        for i, (client, proc) in enumerate(zip(self.clients, self.procs)):
            try:
                client.wait_healthy(timeout_s, process=proc)
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"engine{i}: {e}\n--- last lines of {self.logs[i]} ---\n{tail(self.logs[i])}") from e

    def check(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise RuntimeError(f"engine{i} exited with code {proc.returncode}\n--- last lines of "
                                   f"{self.logs[i]} ---\n{tail(self.logs[i])}")

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        for p in self.procs:
            stop_process(p)


def smoke_run(cfg: RunConfig, engines: Engines, model_path: Path, run_dir: Path) -> dict:
    """Generate groups on every engine while pushing `trainer.max_steps` weight updates in flight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.trainer.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ws = cfg.weight_sync
    world, futures = init_group_on_engines(engines.clients, ws.master_address, ws.master_port, ws.backend,
                                           ws.group_name, ws.timeout_s)
    group = init_weight_update_group(ws.master_address, ws.master_port, 0, world, ws.backend, ws.group_name,
                                     ws.timeout_s)
    for f in futures:
        f.result()
    prompts = [tokenizer.encode(f"{a}+{b}=") for a in range(10, 18) for b in range(3, 7)]
    stop = threading.Event()
    results = []

    def generate(i: int) -> None:
        client = engines.clients[i % len(engines.clients)]
        while not stop.is_set():
            out = client.generate(prompts[i % len(prompts)], temperature=cfg.sampling.temperature,
                                  max_new_tokens=cfg.sampling.max_new_tokens, n=cfg.sampling.group_size,
                                  ignore_eos=True)
            results.append(out)
            i += 7

    metrics_path = run_dir / "metrics.jsonl"
    start = time.monotonic()
    with ThreadPoolExecutor(cfg.actor.concurrency // cfg.sampling.group_size or 1) as pool, \
            open(metrics_path, "a") as metrics_file:
        workers = [pool.submit(generate, i) for i in range(cfg.actor.concurrency // cfg.sampling.group_size or 1)]
        named = list(model.named_parameters())
        g = torch.Generator().manual_seed(cfg.seed)
        for version in tqdm(range(1, cfg.trainer.max_steps + 1), desc="in-flight updates", unit="update"):
            engines.check()
            time.sleep(0.5)  # stands in for an optimizer step
            with torch.no_grad():
                for _, p in named:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            t0 = time.monotonic()
            resp = push_weights(group, engines.clients, [(n, p.detach()) for n, p in named], version,
                                int(ws.bucket_mb * 2**20))
            row = {"version": version, "time": time.monotonic() - start, "push_s": time.monotonic() - t0,
                   "bytes": resp[0].received_bytes, "switch_s": max(r.switch_s for r in resp),
                   "completions": sum(len(r.completions) for r in results)}
            metrics_file.write(json.dumps(row) + "\n")
        stop.set()
        for w in workers:
            w.result()
    elapsed = time.monotonic() - start
    completions = [c for r in results for c in r.completions]
    mixed = sum(1 for c in completions if len(set(c.versions)) > 1)
    engine_metrics = [c.metrics() for c in engines.clients]
    group.destroy()
    return {
        "seconds": round(elapsed, 2),
        "completions": len(completions),
        "tokens": sum(len(c.token_ids) for c in completions),
        "tokens_per_s": round(sum(len(c.token_ids) for c in completions) / elapsed, 1),
        "completions_spanning_an_update": mixed,
        "weight_versions_seen": sorted({v for c in completions for v in c.versions}),
        "updates_applied_while_running": sum(m["pipelinerl_weight_updates_while_running_total"]
                                             for m in engine_metrics),
        "mean_switch_ms": round(1000 * sum(m["pipelinerl_weight_update_switch_seconds_total"]
                                           for m in engine_metrics) / max(1, cfg.trainer.max_steps), 3),
    }


def main(recipe: str, overrides: list[str]) -> int:
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as e:
        print(f"pipelinerl: config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    save_resolved_config(cfg, run_dir)
    model_path = prepare_model(cfg)
    engines = Engines(cfg, model_path, run_dir)
    try:
        print(f"starting {cfg.engine.num_engines} {cfg.engine.kind} engine(s); logs in {run_dir / 'logs'}")
        engines.wait_healthy()
        summary = smoke_run(cfg, engines, model_path, run_dir)
    except KeyboardInterrupt:
        print("interrupted; stopping the engines", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"pipelinerl: run failed: {e}", file=sys.stderr)
        return 1
    finally:
        engines.stop()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"resolved config, metrics and summary in {run_dir}")
    return 0
