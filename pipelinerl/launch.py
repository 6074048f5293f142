"""The launcher role: `pipelinerl run RECIPE.yaml [overrides]`.

It resolves the config into the run directory, prepares the model, starts the engines, waits for them to be
healthy, then starts the trainer and the actor, each as its own process, and watches all of them: if one dies
the run stops with the cause and the child's last log lines; Ctrl-C stops every child. A rerun in the same
run directory resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from pipelinerl.config import ConfigError, RunConfig, load_config, save_resolved_config
from pipelinerl.engines.client import EngineClient
from pipelinerl.procs import engine_command, start_process, stop_process, tail


def prepare_model(cfg: RunConfig) -> Path:
    """The model the run starts from. With `model.init: tiny`, build a small model and give it the supervised
    warm-up; both are cached in `model.path` (a marker records the settings) so a rerun skips them."""
    path = Path(cfg.model.path)
    if cfg.model.init != "tiny":
        return path
    m, t = cfg.model, cfg.task
    settings = {"seed": cfg.seed, "hidden": m.tiny_hidden_size, "layers": m.tiny_layers,
                "warmup_steps": m.warmup_steps, "warmup_lr": m.warmup_lr, "warmup_batch_size": m.warmup_batch_size,
                "task": {"name": t.name, "digits": t.digits, "ops": t.ops, "num_train": t.num_train,
                         "seed": t.seed, "reverse": t.reverse}}
    marker = path / "pipelinerl_base_model.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        print(f"using the cached base model in {path}")
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelinerl.models.tiny import build_tiny_model
    from pipelinerl.models.warmup import supervised_warmup
    from pipelinerl.tasks import task_from_config

    print(f"building a tiny model in {path} (seed {cfg.seed})")
    torch.set_num_threads(max(1, cfg.engine.threads + cfg.trainer.threads))
    build_tiny_model(path, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=cfg.seed,
                     max_positions=max(1024, cfg.engine.max_model_len))
    if m.warmup_steps > 0:
        task = task_from_config(t)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        target = getattr(task, "target", None)
        if target is None:
            raise ConfigError(f"model.warmup_steps: task {t.name!r} has no supervised targets; set it to 0")
        examples = [(task.prompt(p), target(p)) for p in task.train_problems()]
        supervised_warmup(model, tokenizer, examples, m.warmup_steps, m.warmup_batch_size, m.warmup_lr, cfg.seed)
        model.save_pretrained(path)
    marker.write_text(json.dumps(settings))
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


class ChildFailed(RuntimeError):
    pass


def _new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    rows = []
    for line in chunk[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows, offset + end


def run_pipeline(cfg: RunConfig, engines: Engines, run_dir: Path) -> None:
    """Start the trainer and the actor beside the engines, show progress, stop everything at the end."""
    urls = ",".join(c.url for c in engines.clients)
    config = str(run_dir / "config.yaml")
    shutil.rmtree(run_dir / "streams" / "control", ignore_errors=True)  # control messages are per launch
    roles = {
        "trainer": ([sys.executable, "-m", "pipelinerl.train", config, "--engines", urls], cfg.trainer.threads),
        "actor": ([sys.executable, "-m", "pipelinerl.actor", config, "--engines", urls], 1),
    }
    children = {name: start_process(cmd, run_dir / "logs" / f"{name}.log", threads=threads)
                for name, (cmd, threads) in roles.items()}
    pids = {name: p.pid for name, p in children.items()} | {f"engine{i}": p.pid for i, p in enumerate(engines.procs)}
    (run_dir / "pids.json").write_text(json.dumps(pids))
    metrics_path = run_dir / "metrics.jsonl"
    _, offset = _new_rows(metrics_path, 0)  # a resumed run: show only new steps
    bar = tqdm(total=cfg.trainer.max_steps, desc="steps", unit="step", mininterval=1.0, dynamic_ncols=True)
    try:
        while True:
            engines.check()
            for name, proc in children.items():
                code = proc.poll()
                if code is not None and code != 0:  # the actor exits 0 on the trainer's "done"
                    log = run_dir / "logs" / f"{name}.log"
                    raise ChildFailed(f"{name} exited with code {code}\n--- last lines of {log} ---\n{tail(log)}")
            rows, offset = _new_rows(metrics_path, offset)
            for row in rows:
                if "eval_accuracy" in row:
                    bar.write(f"step {row['step']}: held-out pass@1 {row['eval_accuracy']:.3f}")
                    continue
                bar.n = row["step"]
                bar.set_postfix({"samples/s": f"{row['samples_per_s']:.1f}", "tok/s": f"{row['tokens_per_s']:.0f}",
                                 "reward": f"{row['reward_mean']:.3f}", "lag": f"{row.get('lag_mean', 0):.2f}"},
                                refresh=False)
                bar.refresh()
            if children["trainer"].poll() == 0:
                children["actor"].wait(timeout=60)  # it stops on the trainer's "done" message
                for i, client in enumerate(engines.clients):  # what the engines saw, for the record
                    (run_dir / f"engine{i}_metrics.json").write_text(json.dumps(client.metrics(), indent=1))
                return
            time.sleep(0.5)
    finally:
        bar.close()
        for proc in children.values():
            stop_process(proc)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(recipe: str, overrides: list[str]) -> int:
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as e:
        print(f"pipelinerl: config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    # `kill` of the launcher stops the run like Ctrl-C: every child is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    done = finished_version(run_dir)
    if done is not None and done >= cfg.trainer.max_steps:
        print(f"{run_dir} already holds a finished run (version {done} of trainer.max_steps "
              f"{cfg.trainer.max_steps}); to train more raise trainer.max_steps, to start over use another run_dir")
        report(run_dir)
        return 0
    save_resolved_config(cfg, run_dir)
    model_path = prepare_model(cfg)
    engines = Engines(cfg, model_path, run_dir)
    try:
        print(f"starting {cfg.engine.num_engines} {cfg.engine.kind} engine(s); logs in {run_dir / 'logs'}")
        engines.wait_healthy()
        run_pipeline(cfg, engines, run_dir)
    except KeyboardInterrupt:
        print("interrupted; all processes of the run stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"pipelinerl: run failed: {e}", file=sys.stderr)
        return 1
    finally:
        engines.stop()
    report(run_dir)
    return 0


def finished_version(run_dir: Path) -> int | None:
    """The weight version of the run directory's last checkpoint, if it has one."""
    from pipelinerl.trainer.checkpoint import STATE_FILE, latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    return json.loads((ckpt / STATE_FILE).read_text())["version"] if ckpt is not None else None


def report(run_dir: Path) -> None:
    """Held-out accuracy before and after, the curves as PNG, where everything is."""
    from pipelinerl.plot import plot_runs, read_metrics

    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval_accuracy" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        print(f"held-out pass@1: {first['eval_accuracy']:.3f} at step {first['step']} -> "
              f"{last['eval_accuracy']:.3f} at step {last['step']} "
              f"({100 * (last['eval_accuracy'] - first['eval_accuracy']):+.1f} points)")
    try:
        pngs = plot_runs([run_dir])
        print(f"curves: {', '.join(str(p) for p in pngs)}")
    except ValueError as e:
        print(f"no curves: {e}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}; final model: {run_dir / 'final_model'}; logs: {run_dir / 'logs'}")
