"""The launcher role: `pipelinerl run RECIPE.yaml [overrides]`.

It resolves the config into the run directory, prepares the model, starts the engines, waits for them to be
healthy, then starts the trainer and the actor, each as its own process, and watches all of them: if one dies
the run stops with the cause and the child's last log lines; Ctrl-C stops every child. A rerun in the same
run directory resumes from the last checkpoint.

Multi-node (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT in the environment; `pipelinerl.placement` says what runs
where): every node runs this launcher with the same recipe; node 0 does all of the above, the other nodes start
engines and hand their URLs to node 0 through `pipelinerl.nodes`, and with `trainer.num_nodes` > 1 the first ones
also start their share of the trainer processes once node 0 says where those meet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipelinerl.auth import API_KEY_ENV, KEY_FILE, api_key_from_env, is_loopback, read_key_file, run_api_key
from pipelinerl.config import ConfigError, RunConfig, load_config, resolve_for_machine, save_resolved_config
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.engines.client import EngineClient
from pipelinerl.metrics import continue_metrics
from pipelinerl.models.hub import ModelFetchError
from pipelinerl.nodes import NodeLost, NodeRendezvous
from pipelinerl.placement import (
    EngineSlot,
    NodeEnv,
    NodePlan,
    advertised_host,
    detect_gpus,
    gpu_env,
    plan_node,
    why_no_gpus,
)
from pipelinerl.procs import (
    POOL_SOLVED_EXIT,
    engine_command,
    free_port,
    run_in_child,
    start_process,
    stop_process,
    stop_processes,
    tail,
    tool_command,
    wait_for_port,
    write_engine_urls,
)
from pipelinerl.streams import StreamBackendError, check_backend, reset_stream


def prepare_model(cfg: RunConfig) -> Path:
    """The model the run starts from. With `model.init: tiny`, build a small model and give it the supervised
    warm-up; both are cached in `model.path` (a marker records the settings) so a rerun skips them."""
    path = Path(cfg.model.path)
    if cfg.model.init != "tiny":
        return path
    m, t = cfg.model, cfg.task
    seed = cfg.seed if m.seed is None else m.seed
    settings = {"seed": seed, "hidden": m.tiny_hidden_size, "layers": m.tiny_layers,
                "warmup_steps": m.warmup_steps, "warmup_lr": m.warmup_lr, "warmup_batch_size": m.warmup_batch_size,
                "task": {"name": t.name, "digits": t.digits, "ops": t.ops, "num_train": t.num_train,
                         "seed": t.seed, "reverse": t.reverse}}
    if t.args:  # (absent without them, so existing caches stay valid)
        settings["task"].update(name=t.name, args=dict(t.args))
    if m.tiny_tokenizer != "char":  # (absent for the char tokenizer, so existing caches stay valid)
        settings["tokenizer"] = {"kind": m.tiny_tokenizer, "vocab_size": m.tiny_vocab_size}
    if t.name == "math":
        settings["task"].update(train_data=list(t.train_data), template=t.template)
    marker = path / "pipelinerl_base_model.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        print(f"using the cached base model in {path}")
        return path
    import torch

    from pipelinerl.models.tiny import build_tiny_model
    from pipelinerl.models.warmup import warm_up_saved_model
    from pipelinerl.tasks import task_from_config

    print(f"building a tiny model in {path} (seed {seed})")
    # built beside the cache and swapped in whole at the end: a build that is stopped or fails (minutes of warm-up
    # on a CPU) leaves the model cached before it, under its own marker, instead of new weights under an old marker
    building = path.with_name(f".{path.name}.building")
    shutil.rmtree(building, ignore_errors=True)
    torch.set_num_threads(max(1, cfg.engine.threads + cfg.trainer.threads))
    task = task_from_config(t)
    target = getattr(task, "target", None)  # the warm-up's supervised answers, where the task has them
    tokenizer = None
    if m.tiny_tokenizer == "bpe":
        from pipelinerl.models.tiny import build_bpe_tokenizer

        texts = [task.prompt(p) + (target(p) if target and m.warmup_steps else "") for p in task.train_problems()]
        tokenizer = build_bpe_tokenizer(texts, m.tiny_vocab_size)
    build_tiny_model(building, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=seed,
                     max_positions=max(1024, cfg.engine.max_model_len), tokenizer=tokenizer)
    if m.warmup_steps > 0:
        if target is None:
            raise ConfigError(f"model.warmup_steps: task {t.name!r} has no supervised targets; set it to 0")
        examples = [(task.prompt(p), target(p)) for p in task.train_problems()]
        args = (str(building), examples, m.warmup_steps, m.warmup_batch_size, m.warmup_lr, seed)
        if torch.cuda.is_available():
            # On GPU 0, before any engine or trainer holds it: seconds where the node's CPU took minutes (float32
            # either way). In a child process, so that this launcher, which lives as long as the run, never holds
            # a CUDA context (memory on GPU 0, and a GPU in exclusive-process mode refused to the trainer).
            print("the supervised warm-up runs on GPU 0")
            run_in_child(warm_up_saved_model, *args, "cuda")
        else:
            warm_up_saved_model(*args)
    (building / marker.name).write_text(json.dumps(settings))
    replace_dir(building, path)
    return path


def fetch_hub_model(cfg: RunConfig) -> RunConfig:
    """`cfg` with a hub name in `model.path` replaced by its local snapshot, fetched once here (node 0's launcher)
    before any engine or trainer process starts, so that none of them downloads it (`pipelinerl.models.hub`)."""
    from pipelinerl.models.hub import is_hub_name

    if cfg.model.init == "tiny" or not is_hub_name(cfg.model.path):
        return cfg
    local = fetch_model(cfg.model.path)
    print(f"model {cfg.model.path}: {local}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(local)))


def fetch_model(name: str) -> Path:
    from pipelinerl.models.hub import fetch_model as fetch

    return fetch(name)


def replace_dir(new: Path, path: Path) -> None:
    """Put directory `new` at `path`, removing what was there. Stopped between its two renames, `path` is missing
    (rebuilt by the next run), never half old and half new."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    new.rename(path)
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class ProcessSpec:
    """A child process of the run, before it starts: what `--dry-run` prints and `start_process` starts."""

    name: str
    command: list[str]
    env: dict[str, str]  # set beside the launcher's own environment
    log: Path
    threads: int | None = None

    def start(self) -> subprocess.Popen:
        return start_process(self.command, self.log, threads=self.threads, env=self.env)

    def describe(self) -> str:
        env = dict(self.env)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads))
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        shown = shown or "(the launcher's)"
        return f"{self.name}: {shlex.join(self.command)}\n    env: {shown}\n    log: {self.log}"


def engine_specs(cfg: RunConfig, model_path: Path, slots: Sequence[EngineSlot], log_dir: Path,
                 start_timeout_s: float) -> list[tuple[ProcessSpec, Path, Callable[[int], list[str]]]]:
    """Each engine's process (with engine.base_port 0 it binds a free port itself and writes it to its port
    file), the port file, and its command for a given port (a restart keeps the port it had)."""
    e = cfg.engine
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = []
    for slot in slots:
        name = f"engine{slot.index}"
        port_file = log_dir / f"{name}.port"
        extra = ["--max-running-seqs", str(e.max_running_seqs), "--max-batch-tokens", str(e.max_batch_tokens),
                 "--max-model-len", str(e.max_model_len), "--threads", str(e.threads),
                 "--dtype", cfg.model.dtype, "--port-file", str(port_file), "--start-timeout-s", f"{start_timeout_s:g}"]
        if e.tensor_parallel_size > 1:
            extra += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
        env = slot.env(visible)
        if slot.gpus:
            env.update(gpu_memory_args(e))
        launch_env = engine_kind(e.kind).launch_env
        if launch_env is not None:
            env.update(launch_env(cfg))

        def command(port: int, extra: list[str] = extra) -> list[str]:
            return engine_command(str(model_path), port, e.host, e.kind, extra)

        out.append((ProcessSpec(name, command(slot.port), env, log_dir / f"{name}.log", e.threads), port_file,
                    command))
    return out


class Engines:
    """The engine child processes on this node; `check()` raises with the log tail if one died."""

    def __init__(self, cfg: RunConfig, model_path: Path, slots: Sequence[EngineSlot], log_dir: Path,
                 advertise_host: str | None = None, start_timeout_s: float = 900.0):
        e = cfg.engine
        self.host = advertise_host or e.host
        self.start_timeout_s = start_timeout_s
        specs = engine_specs(cfg, model_path, slots, log_dir, start_timeout_s)
        self.names = [spec.name for spec, _, _ in specs]
        self.logs = [spec.log for spec, _, _ in specs]
        self.port_files = [port_file for _, port_file, _ in specs]
        self.procs, self.clients = [], []
        self.max_restarts, self.threads = e.max_restarts, e.threads
        self.restarts = [0] * len(slots)
        self._start_args: list[tuple[Callable[[int], list[str]], dict[str, str]]] = []
        for spec, port_file, command in specs:
            port_file.unlink(missing_ok=True)
            self._start_args.append((command, spec.env))
            self.procs.append(spec.start())

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in zip(self.names, self.procs)}

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def wait_healthy(self, check: Callable[[], None] | None = None) -> None:
        """Learn each engine's port (it binds a free one when engine.base_port is 0), then wait for health, up to
        the engines' start deadline (engine.start_timeout_s). `check` is called while waiting: what it raises (a
        role started meanwhile that failed) ends the wait."""
        timeout_s = self.start_timeout_s
        # a minute past the engine's own deadline (given to vLLM's and SGLang's fronts), whose message says more
        deadline = time.monotonic() + timeout_s + 60.0
        for name, proc, log, port_file in zip(self.names, self.procs, self.logs, self.port_files):
            try:
                port = wait_for_port(port_file, proc, deadline - time.monotonic(), check=check)
                client = EngineClient(f"http://{self.host}:{port}")
                self.clients.append(client)
                client.wait_healthy(max(1.0, deadline - time.monotonic()), process=proc, check=check)
            except ChildFailed:
                raise
            except TimeoutError as e:
                raise RuntimeError(f"{name}: {e} (engine.start_timeout_s {timeout_s:g}; raise it for a model that "
                                   f"loads slowly)\n--- last lines of {log} ---\n{tail(log)}") from e
            except RuntimeError as e:
                raise RuntimeError(f"{name}: {e}\n--- last lines of {log} ---\n{tail(log)}") from e

    def check(self) -> None:
        """Restart an engine that died (on the port it had, so its URL stays), up to `engine.max_restarts` times
        each; past that, raise naming it with its log's last lines. The trainer re-forms the weight-update group
        when the engine answers again, and the actor sends its requests to the other engines meanwhile."""
        for i, (name, proc, log) in enumerate(zip(self.names, self.procs, self.logs)):
            if proc.poll() is None:
                continue
            code = proc.returncode
            if self.restarts[i] >= self.max_restarts or i >= len(self.clients):
                limit = f" after {self.restarts[i]} restart(s) (engine.max_restarts={self.max_restarts})" \
                    if self.restarts[i] else ""
                raise RuntimeError(f"{name} exited with code {code}{limit}\n--- last lines of {log} ---\n{tail(log)}")
            self.restarts[i] += 1
            stop_process(proc)  # whatever it left in its process group (vLLM's workers)
            command, env = self._start_args[i]
            port = int(urllib.parse.urlsplit(self.clients[i].url).port)
            with open(log, "a") as f:
                f.write(f"\n--- pipelinerl: {name} exited with code {code}; restart {self.restarts[i]} of "
                        f"{self.max_restarts} ---\n")
            print(f"{name} exited with code {code}; restarting it ({self.restarts[i]} of {self.max_restarts}, "
                  f"engine.max_restarts), log in {log}", file=sys.stderr, flush=True)
            self.procs[i] = start_process(command(port), log, threads=self.threads, env=env)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        stop_processes(self.procs)  # all at once: one shared wait, however many engines


def gpu_memory_args(e) -> dict[str, str]:
    """The engine's share of its GPU (`engine.gpu_memory_utilization`) in the words of the engine it starts,
    ahead of any arguments the user gives in the same environment variable (so the user's win)."""
    flag = engine_kind(e.kind).gpu_memory_flag
    if flag is None:
        return {}
    var, flag = flag
    return {var: f"{flag} {e.gpu_memory_utilization} {os.environ.get(var, '')}".strip()}


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


def trainer_command(cfg: RunConfig, config: str, urls: str, gpus: int, node_rank: int = 0,
                    main_addr: str = "127.0.0.1", main_port: int = 0) -> list[str]:
    """One process, or `trainer.num_processes` under accelerate (GPUs, or an accelerate config such as
    DeepSpeed ZeRO-3) or torchrun (data parallel on CPU, where `accelerate launch` would need mpirun).

    With `trainer.num_nodes` > 1 this is trainer node `node_rank`'s share (num_processes / num_nodes processes,
    global ranks from node_rank * share): the launchers of all trainer nodes start theirs with the same arguments
    but the rank, and they meet at `main_addr`:`main_port` (node 0's address, a port node 0 chose)."""
    t = cfg.trainer
    role = ["-m", "pipelinerl.train", config, "--engines", urls]
    if t.num_processes == 1 and not t.accelerate_config:
        return [sys.executable, *role]
    nodes = t.num_nodes
    if not gpus and not t.accelerate_config:
        if nodes == 1:  # --standalone: torchrun's own rendezvous on a port it picks itself
            return tool_command("torch.distributed.run", "--standalone", "--nproc-per-node", str(t.num_processes),
                                *role)
        return tool_command("torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node_rank),
                            "--master-addr", main_addr, "--master-port", str(main_port),
                            "--nproc-per-node", str(t.num_processes // nodes), *role)
    launch = tool_command("accelerate.commands.launch", "--num_processes", str(t.num_processes))
    if nodes == 1:
        launch += ["--num_machines", "1", "--main_process_port", str(free_port())]
    else:
        launch += ["--num_machines", str(nodes), "--machine_rank", str(node_rank), "--main_process_ip", main_addr,
                   "--main_process_port", str(main_port)]
        if t.accelerate_config:
            # accelerate's default for DeepSpeed on several machines is pdsh, one command reaching every node over
            # ssh; here every node's launcher starts its own share, which "standard" (torchrun per node) does
            launch += ["--deepspeed_multinode_launcher", "standard"]
    if t.accelerate_config:
        launch += ["--config_file", t.accelerate_config]
    elif t.num_processes > 1:
        launch += ["--multi_gpu"]
    return [*launch, *role]


def trainer_env(plan: NodePlan) -> dict[str, str]:
    """The environment of this node's trainer processes beside the launcher's own: the node's trainer GPUs."""
    return gpu_env(plan.trainer_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def role_specs(cfg: RunConfig, engines: str, run_dir: Path, plan: NodePlan, trainer_port: int = 0
               ) -> list[ProcessSpec]:
    """The trainer and the actor. `engines`: their `--engines` argument, the engine URLs or `@FILE` (they load
    their models and wait for the file, which `run_main_node` writes once every engine answers). `trainer_port`:
    where the trainer processes of all trainer nodes meet (trainer.num_nodes > 1)."""
    config = str(run_dir / "config.yaml")
    gpus = plan.trainer_gpus
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""} if gpus else {}  # the actor and reward workers never need one
    trainer = trainer_command(cfg, config, engines, len(gpus), 0, plan.node.master_addr, trainer_port)
    logs = run_dir / "logs"
    return [ProcessSpec("trainer", trainer, trainer_env(plan), logs / "trainer.log", cfg.trainer.threads),
            ProcessSpec("actor", [sys.executable, "-m", "pipelinerl.actor", config, "--engines", engines], no_gpu,
                        logs / "actor.log", 1)]


def start_roles(cfg: RunConfig, engines: str, run_dir: Path, plan: NodePlan, trainer_port: int = 0
                ) -> dict[str, subprocess.Popen]:
    """Start the trainer and the actor (`role_specs`)."""
    reset_stream(cfg.streams, run_dir, "control")  # control messages are per launch
    # a resumed run redoes the steps after its checkpoint: their old rows go now, before progress reads the file
    continue_metrics(run_dir, resumed_version(run_dir))
    return {spec.name: spec.start() for spec in role_specs(cfg, engines, run_dir, plan, trainer_port)}


def check_roles(children: dict[str, subprocess.Popen], run_dir: Path) -> None:
    """Raise ChildFailed naming a role that exited with an error, with its log's last lines."""
    for name, proc in children.items():
        code = proc.poll()
        if name == "actor" and code == POOL_SOLVED_EXIT:
            continue  # every training problem solved: follow_pipeline ends the run as a success
        if code is not None and code != 0:  # the actor exits 0 on the trainer's "done"
            log = run_dir / "logs" / f"{name}.log"
            raise ChildFailed(f"{name} exited with code {code}\n--- last lines of {log} ---\n{tail(log)}")


def follow_pipeline(cfg: RunConfig, children: dict[str, subprocess.Popen], urls: list[str], run_dir: Path,
                    check: Callable[[], None]) -> None:
    """Show progress until the trainer finishes; then record what the engines saw. `check` raises when an engine
    (on any node) is gone."""
    metrics_path = run_dir / "metrics.jsonl"
    _, offset = _new_rows(metrics_path, 0)  # a resumed run: show only new steps
    progress = Progress(cfg.trainer.max_steps, cfg.metrics.log_every_s, resumed_at=resumed_version(run_dir))
    try:
        while True:
            check()
            check_roles(children, run_dir)
            rows, offset = _new_rows(metrics_path, offset)
            for row in rows:
                progress.show(row)
            if children["actor"].poll() == POOL_SOLVED_EXIT:
                print(f"pipelinerl: every training problem was solved (all {cfg.sampling.group_size} answers right) "
                      "and retired (actor.retire_solved), so nothing is left to learn from: the run ends here, its "
                      "trainer saving a checkpoint (RUN_DIR/logs/actor.log)", file=sys.stderr)
                return
            if children["trainer"].poll() == 0:
                children["actor"].wait(timeout=60)  # it stops on the trainer's "done" message
                for i, url in enumerate(urls):  # what the engines saw, for the record
                    client = EngineClient(url)
                    try:
                        (run_dir / f"engine{i}_metrics.json").write_text(json.dumps(client.metrics(), indent=1))
                    finally:
                        client.close()
                return
            time.sleep(0.5)
    finally:
        progress.close()


def write_pids(run_dir: Path, roles: dict[str, subprocess.Popen], engine_pids: dict[str, int]) -> None:
    """RUN_DIR/pids.json: the process ids of the run's roles and engines on this node, for whoever must signal one."""
    (run_dir / "pids.json").write_text(json.dumps({name: p.pid for name, p in roles.items()} | engine_pids))


def stop_roles(cfg: RunConfig, children: dict[str, subprocess.Popen]) -> None:
    """The trainer and the actor at once: the trainer given `trainer.stop_grace_s` to save its checkpoint (it saves
    on SIGTERM), the actor, which saves nothing, 10 s; then whatever lingers is killed."""
    others = [p for name, p in children.items() if name != "trainer"]
    for proc in others:  # the actor stops while the trainer saves
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    if "trainer" in children:
        stop_process(children["trainer"], timeout_s=cfg.trainer.stop_grace_s)
    stop_processes(others)


def node_api_key(run_dir: Path) -> str:
    """The run's key on a node other than 0: PIPELINERL_API_KEY, else the RUN_DIR/api_key node 0 wrote."""
    key = api_key_from_env()
    if key:
        return key
    try:
        return read_key_file(run_dir / KEY_FILE)
    except ValueError as e:
        raise RuntimeError(f"no API key for this node's engines ({e}): set {API_KEY_ENV} to the same value on every "
                           "node, or put RUN_DIR on a filesystem the nodes share") from None


class Progress:
    """The run's progress from its metrics rows: a tqdm bar on a terminal; elsewhere (a log file, a batch job)
    a plain summary line every `every_s` seconds, and each held-out evaluation, instead of a bar redrawn with
    carriage returns."""

    def __init__(self, max_steps: int, every_s: float, resumed_at: int = 0, terminal: bool | None = None):
        self.max_steps, self.every_s, self.resumed_at = max_steps, every_s, resumed_at
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self.bar = tqdm(total=max_steps, initial=resumed_at, desc="steps", unit="step", mininterval=1.0,
                        dynamic_ncols=True, disable=not self.terminal)
        self.started = time.monotonic()
        self.last_line = -math.inf

    def show(self, row: dict) -> None:
        if "eval_accuracy" in row:
            self._print(f"step {row['step']}: held-out pass@1 {row['eval_accuracy']:.3f}")
            return
        if self.terminal:
            self.bar.n = row["step"]
            self.bar.set_postfix({"samples/s": f"{row['samples_per_s']:.1f}", "tok/s": f"{row['tokens_per_s']:.0f}",
                                  "reward": f"{row['reward_mean']:.3f}", "lag": f"{row.get('lag_mean', 0):.2f}"},
                                 refresh=False)
            self.bar.refresh()
        elif time.monotonic() - self.last_line >= self.every_s or row["step"] >= self.max_steps:
            self._print(self.summary(row))

    def summary(self, row: dict) -> str:
        """One line: step, share done, throughput, reward, lag, time so far and left."""
        step, elapsed = row["step"], time.monotonic() - self.started
        done_here = step - self.resumed_at
        eta = elapsed / done_here * (self.max_steps - step) if done_here > 0 else None
        return (f"step {step}/{self.max_steps} ({100 * step / self.max_steps:.0f}%) | "
                f"{row['samples_per_s']:.1f} samples/s | {row['tokens_per_s']:.0f} tok/s | "
                f"reward {row['reward_mean']:.3f} | lag {row.get('lag_mean', 0):.2f} | "
                f"elapsed {_duration(elapsed)}" + (f" | left ~{_duration(eta)}" if eta is not None else ""))

    def _print(self, line: str) -> None:
        if self.terminal:
            self.bar.write(line)
        else:
            print(line, flush=True)
            self.last_line = time.monotonic()

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def resumed_version(run_dir: Path) -> int:
    """The version of the newest complete checkpoint of the run, 0 if none: where a rerun's trainer resumes.
    (Read from the files, without importing the trainer.)"""
    best = 0
    for state in (run_dir / "checkpoints").glob("step_*/trainer_state.json"):
        try:
            best = max(best, int(json.loads(state.read_text())["version"]))
        except (OSError, ValueError, KeyError):
            continue
    return best


class Interrupted(KeyboardInterrupt):
    """The launcher was asked to stop (Ctrl-C, SIGTERM, SIGUSR1): the run stops, the trainer saving first."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def main(recipe: str, overrides: list[str], dry_run: bool = False) -> int:
    """`pipelinerl run`: exit 0 when the run finished, 1 when it failed, 2 when it could not start here (a config
    error, or what `preflight` found), 128 + N when stopped by signal N. With `dry_run`: what this node would start,
    and whether it could, starting nothing (exit 0 or 2)."""
    try:
        cfg = load_config(recipe, overrides)
        node = NodeEnv.from_environ()
        gpus = detect_gpus()
        problems, warnings = preflight(cfg, recipe, node, gpus)
        for warning in warnings:
            print(f"pipelinerl: warning: {warning}", file=sys.stderr)
        if problems and not dry_run:  # (a dry run lists them after what would start)
            print(f"pipelinerl: {recipe} cannot start here:\n" + "\n".join(f"- {p}" for p in problems),
                  file=sys.stderr)
            return 2
        # "auto" settings (model.dtype, weight_sync.backend) decided for this node's GPUs, before the resolved
        # config is written for the children and the engines are given their dtype
        cfg, notes = resolve_for_machine(cfg, gpus)
        for note in notes:
            print(f"pipelinerl: {note}")
        plan = plan_node(cfg, node, gpus)
    except ConfigError as e:
        if dry_run and problems:
            print(f"pipelinerl: {recipe} cannot start here:\n" + "\n".join(f"- {p}" for p in problems),
                  file=sys.stderr)
        print(f"pipelinerl: config error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        return print_dry_run(cfg, recipe, plan, gpus, problems)
    # The node's place in the run is read; the children must not take it for their own (a trainer process that
    # saw WORLD_SIZE=2 would wait for a second trainer rank that never comes).
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    # `kill` of the launcher (and SLURM's pre-emption warning, SIGUSR1) stops the run like Ctrl-C: the trainer
    # saves a checkpoint, every child is stopped on the way out, and the exit code says the run did not finish.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, _interrupt)
    try:
        if node.rank > 0:
            return run_engine_node(cfg, plan)
        return run_main_node(cfg, plan)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        version = resumed_version(Path(cfg.run_dir))
        print(f"interrupted by {signal.Signals(signum).name}; all processes of the run stopped. The newest "
              f"checkpoint is at step {version}: rerun the same command to resume from it.", file=sys.stderr)
        return 128 + signum


def preflight(cfg: RunConfig, recipe: str, node: NodeEnv, gpus: int) -> tuple[list[str], list[str]]:
    """(problems, warnings): what stops this recipe on this node before anything starts, each naming what to do,
    and what is worth saying. A 7B run should not load its model and start 8 engines only to fail on a path, a
    missing package or a full disk."""
    problems = missing_data(cfg) + missing_resources(cfg, recipe, node, gpus) + missing_engine(cfg, gpus)
    warnings: list[str] = []
    if cfg.task.name not in ("arithmetic", "math"):
        # a task from task.name/task.args is built here once, so a wrong path or argument stops the run now
        # with the key to change, not later in the actor's log
        from pipelinerl.tasks import check_task

        task = check_task(cfg.task)
        budget = getattr(task, "total_time_s", None)  # the code checker's own time for one answer
        if budget is not None and cfg.reward.timeout_s <= budget:
            raise ConfigError(f"reward.timeout_s: {cfg.reward.timeout_s:g} s would cut off the checks of an "
                              f"answer, which may take task.args.total_time_s {budget:g} s; set it above that")
    if node.rank == 0:
        problem, warning = run_dir_disk(cfg)
        problems += [problem] if problem else []
        warnings += [warning] if warning else []
    return problems, warnings


def missing_engine(cfg: RunConfig, gpus: int) -> list[str]:
    """The engine package the recipe's engine.kind needs, when it is missing or of the wrong build for this node."""
    from pipelinerl.gpu_setup import engine_problem

    problem = engine_problem(cfg.engine.kind, gpus > 0)
    return [f"engine.kind {cfg.engine.kind}: {problem}"] if problem else []


def run_dir_disk(cfg: RunConfig) -> tuple[str | None, str | None]:
    """(problem, warning) about the run directory's filesystem and the checkpoints it must hold (`sizing`). Not
    worked out for a tiny model (megabytes) nor for a model whose shape is not known before it is fetched (checked
    again once it is)."""
    if cfg.model.init == "tiny":  # (checkpoints are also written at the end and when stopped: always checked)
        return None, None
    from pipelinerl import plan as planning
    from pipelinerl.sizing import checkpoint_size, disk_problem

    try:
        shape = planning.model_shape(cfg)
        sharding = planning.detect_sharding(cfg)
    except ConfigError:
        return None, None
    bf16 = planning._precision(cfg, cfg.resources.gpus_per_node > 0) == "bf16"
    size = checkpoint_size(cfg, shape.num_params, sharding.deepspeed, bf16)
    where = Path(cfg.run_dir).absolute()
    while not where.exists():
        where = where.parent
    return disk_problem(cfg, size, shutil.disk_usage(where).free, str(where))


def engine_start_timeout(cfg: RunConfig) -> float:
    """engine.start_timeout_s, or (unset) sized from the model's weights (`sizing.engine_start_timeout_s`)."""
    from pipelinerl import plan as planning
    from pipelinerl.sizing import MIN_ENGINE_START_S, engine_start_timeout_s

    if cfg.engine.start_timeout_s is not None:
        return float(cfg.engine.start_timeout_s)
    if cfg.model.init == "tiny":
        return MIN_ENGINE_START_S
    try:
        return engine_start_timeout_s(cfg, planning.model_shape(cfg).num_params)
    except ConfigError:
        return MIN_ENGINE_START_S


def print_dry_run(cfg: RunConfig, recipe: str, plan: NodePlan, gpus: int, problems: list[str]) -> int:
    """`pipelinerl run --dry-run`: every process this node would start (command, environment, GPUs, log), the
    model and where it comes from, the engine package, and whether the run could start; nothing is started."""
    run_dir = Path(cfg.run_dir)
    node = plan.node
    print(f"pipelinerl run {recipe} --dry-run: node {node.rank} of {node.world_size}, {gpus} GPU(s) seen by torch; "
          "nothing is started")
    print(plan.describe())
    model_path, model_note = dry_run_model(cfg)
    print(f"model: {model_note}")
    print(f"engine: {cfg.engine.kind}, {engine_import_check(cfg.engine.kind)}; each must answer within "
          f"{engine_start_timeout(cfg):g} s (engine.start_timeout_s)")
    log_dir = run_dir / "logs" if node.rank == 0 else run_dir / "logs" / f"node{node.rank}"
    specs = [spec for spec, _, _ in engine_specs(cfg, model_path, plan.engines, log_dir, engine_start_timeout(cfg))]
    engines = f"@{run_dir / 'logs' / 'engine_urls'}"
    if node.rank == 0:
        port_note = " (the port where the trainer nodes meet: picked by node 0 at launch)" if plan.trainer_nodes > 1 \
            else ""
        specs += role_specs(cfg, engines, run_dir, plan)
        if port_note:
            print(f"trainer: {plan.trainer_processes} of trainer.num_processes {cfg.trainer.num_processes} here, "
                  f"over trainer.num_nodes {plan.trainer_nodes} nodes{port_note}")
    elif plan.runs_trainer:
        cmd = trainer_command(cfg, str(run_dir / "config.yaml"), "<every engine's URL, from node 0>",
                              len(plan.trainer_gpus), node.rank, node.master_addr, 0)
        specs.append(ProcessSpec(f"trainer {plan.trainer_ranks}", cmd, trainer_env(plan), log_dir / "trainer.log",
                                 cfg.trainer.threads))
    print("processes:")
    for spec in specs:
        print("  " + spec.describe().replace("\n", "\n  "))
    if problems:
        print(f"would not start: {len(problems)} problem(s)\n" + "\n".join(f"- {p}" for p in problems))
        return 2
    print("ready: `pipelinerl run` with the same arguments starts these")
    return 0


def dry_run_model(cfg: RunConfig) -> tuple[Path, str]:
    """(the path the engines would be given, where it comes from) without fetching or building anything."""
    path = cfg.model.path
    if cfg.model.init == "tiny":
        return Path(path), f"{path}: a tiny model the launcher builds (and warms up) there, or reuses if cached"
    from pipelinerl.models.hub import cache_dir, cached_model, is_hub_name

    if not is_hub_name(path):
        return Path(path), f"{path} (a local directory{'' if Path(path).is_dir() else ', which does not exist'})"
    cached = cached_model(path)
    if cached is not None:
        return cached, f"{path} from the Hugging Face cache, {cached} (every process of the run reads it there)"
    snapshot = cache_dir() / f"models--{path.replace('/', '--')}" / "snapshots" / "REVISION"
    return snapshot, (f"{path} from the Hugging Face hub, not cached yet: node 0's launcher fetches it once into "
                      f"{cache_dir()} before any engine starts, and every process reads it there (REVISION: the "
                      "commit fetched)")


def engine_import_check(kind: str) -> str:
    """Whether the engine's package imports in this venv (in a child: vLLM's import takes seconds and sets up
    state), in words."""
    module = engine_kind(kind).package
    if module is None:
        return "built in"
    code = f"import importlib.metadata as m, {module}; print(getattr({module}, '__version__', '?'))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"`import {module}` did not finish in 300 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import {module}` fails: {last}"
    return f"{module} {done.stdout.strip()} imports"


def missing_data(cfg: RunConfig) -> list[str]:
    """Local data files the recipe names that are not there, each with the command that fetches it. Checked
    before anything starts: a 7B run should not load its model and start 4 engines only to fail on a path."""
    if cfg.task.name != "math":
        return []
    from pipelinerl.data import missing_data_hint

    problems = []
    for key, sources in (("task.train_data", cfg.task.train_data), ("task.eval_data", cfg.task.eval_data)):
        for source in sources:
            if Path(source).exists() or not _looks_local(source):
                continue
            hint = missing_data_hint(source)
            problems.append(f"{key}: {source} does not exist; "
                            + (hint or "point it at a local JSON/JSONL file or a Hugging Face dataset name"))
    return problems


def _looks_local(source: str) -> bool:
    """A path rather than a Hugging Face dataset name ("org/name" or "org/name:split")."""
    return source.endswith((".json", ".jsonl")) or source.startswith((".", "/")) or source.count("/") > 1


def missing_resources(cfg: RunConfig, recipe: str, node: NodeEnv, gpus: int) -> list[str]:
    """What the recipe needs (`resources`) and this machine lacks, said plainly, with where to go from here."""
    r = cfg.resources
    if r.gpus_per_node == 0:
        return []
    need = (f"{r.nodes} node(s) with {r.gpus_per_node} GPUs each"
            + (f" of at least {r.gpu_memory_gib:g} GiB" if r.gpu_memory_gib else ""))
    problems = []
    if gpus < r.gpus_per_node:
        why = why_no_gpus(gpus)
        problems.append(f"resources: the recipe needs {need}; this node has {gpus} GPU(s)"
                        + (f": {why}" if why else
                           f". `pipelinerl plan {recipe}` shows where every process goes and the memory each GPU "
                           "needs (it runs anywhere); a smaller cluster can be planned with its --nodes/"
                           "--gpus-per-node flags"))
    if node.world_size < r.nodes:
        problems.append(f"resources.nodes: the recipe runs on {r.nodes} nodes, this launch has WORLD_SIZE="
                        f"{node.world_size}; start it on every node with WORLD_SIZE, RANK, MASTER_ADDR and "
                        f"MASTER_PORT set, or on SLURM: sbatch --nodes {r.nodes} --gpus-per-node {r.gpus_per_node} "
                        f"configs/slurm/pipelinerl.sbatch {recipe}")
    return problems


def run_main_node(cfg: RunConfig, plan: NodePlan) -> int:
    """Node 0 (the only node of a single-node run): model, engines, trainer, actor, progress, report."""
    run_dir = Path(cfg.run_dir)
    node = plan.node
    if node.multi_node and is_loopback(cfg.weight_sync.master_address) and not is_loopback(node.master_addr):
        cfg.weight_sync.master_address = node.master_addr  # engines on other nodes join the trainer's group there
    try:
        check_backend(cfg.streams)  # an unreachable Redis stops the run before any process starts
    except StreamBackendError as e:
        print(f"pipelinerl: {e}", file=sys.stderr)
        return 2
    # the store's values are signed with the run's key, which the launcher makes below (before any value is set)
    rendezvous = NodeRendezvous(node, key=lambda: os.environ[API_KEY_ENV]) if node.multi_node else None
    ok = False
    try:
        done = resumed_version(run_dir)
        if done >= cfg.trainer.max_steps:
            print(f"{run_dir} already holds a finished run (version {done} of trainer.max_steps "
                  f"{cfg.trainer.max_steps}); to train more raise trainer.max_steps, to start over use another "
                  "run_dir")
            report(run_dir)
            ok = True
            return 0
        model_name = cfg.model.path
        try:
            cfg = fetch_hub_model(cfg)
        except ModelFetchError as e:
            print(f"pipelinerl: {e}", file=sys.stderr)
            return 2
        problem, _ = run_dir_disk(cfg)  # again, now that the model's config is at hand
        if problem:
            print(f"pipelinerl: {cfg.run_dir} cannot hold this run's checkpoints:\n- {problem}", file=sys.stderr)
            return 2
        save_resolved_config(cfg, run_dir)
        # owner only: samples, evaluations and checkpoints hold the answers, and sandboxed programs (the code
        # reward, tools) run as other users that must not read them
        run_dir.chmod(0o700)
        # the key every engine of the run requires; the processes started from here (and this one's clients) read
        # it from the environment (pipelinerl/auth.py)
        os.environ[API_KEY_ENV] = run_api_key(run_dir)
        try:
            model_path = prepare_model(cfg)
        except ConfigError as e:
            print(f"pipelinerl: config error: {e}", file=sys.stderr)
            return 2
        start_timeout_s = engine_start_timeout(cfg)
        if rendezvous:
            rendezvous.model_ready(str(model_path), model_name, start_timeout_s)
        print(plan.describe())
        urls_file = run_dir / "logs" / "engine_urls"
        urls_file.unlink(missing_ok=True)  # a previous launch's engines had other ports
        engines = Engines(cfg, model_path, plan.engines, run_dir / "logs", start_timeout_s=start_timeout_s)
        children: dict[str, subprocess.Popen] = {}
        try:
            print(f"starting {len(plan.engines)} {cfg.engine.kind} engine(s); logs in {run_dir / 'logs'}")
            # the trainer and the actor import and load their models while the engines load theirs, then wait for
            # the engines' URLs. Not when a trainer of several nodes (its other nodes need the URLs to start), nor
            # when engines share the trainer's GPUs: vLLM sizes its KV cache from the memory it sees used on its GPU
            # while it starts, which a trainer loading beside it would change under it
            early = cfg.trainer.num_nodes == 1 and not (cfg.engine.colocate_with_trainer and plan.trainer_gpus)
            if early:
                children = start_roles(cfg, f"@{urls_file}", run_dir, plan)
                write_pids(run_dir, children, engines.pids)
            engines.wait_healthy(check=lambda: check_roles(children, run_dir))
            urls, check, trainer_port = engines.urls, engines.check, 0
            if rendezvous:
                urls = rendezvous.gather_engines(urls, engines.check, start_timeout_s)
                print(f"engines of all {node.world_size} nodes: {', '.join(urls)}")
                if cfg.trainer.num_nodes > 1:  # the other trainer nodes start their processes now
                    trainer_port = free_port()
                    rendezvous.start_trainer(trainer_port, urls)

                def check() -> None:
                    engines.check()
                    rendezvous.raise_if_failed()
                    rendezvous.check_nodes()
            write_engine_urls(urls_file, urls)
            if not early:
                children = start_roles(cfg, ",".join(urls), run_dir, plan, trainer_port)
                write_pids(run_dir, children, engines.pids)
            follow_pipeline(cfg, children, urls, run_dir, check)
        except (RuntimeError, TimeoutError) as e:
            if rendezvous and isinstance(e, ChildFailed):
                e = rendezvous.root_cause(e)
            print(f"pipelinerl: run failed: {e}", file=sys.stderr)
            return 1
        finally:
            stop_roles(cfg, children)
            engines.stop()
        report(run_dir)
        ok = True
        return 0
    finally:
        if rendezvous:
            rendezvous.finish(ok)


class RunOver(Exception):
    def __init__(self, status: str):
        self.status = status


def run_engine_node(cfg: RunConfig, plan: NodePlan) -> int:
    """Nodes 1..WORLD_SIZE-1 of a multi-node run: serve engines to node 0 and, on the trainer's other nodes (ranks
    below trainer.num_nodes), run this node's share of the trainer processes, until node 0 says the run is over."""
    node = plan.node
    run_dir = Path(cfg.run_dir)
    log_dir = run_dir / "logs" / f"node{node.rank}"
    try:
        # node 0 writes the run's key before it sets any value; this node reads it when it first checks one
        rendezvous = NodeRendezvous(node, key=lambda: node_api_key(run_dir))
        rendezvous.start_heartbeat()
    except NodeLost as e:
        print(f"pipelinerl: {e}", file=sys.stderr)
        return 1

    def stop_when_over() -> None:
        status = rendezvous.finished()
        if status is not None:
            raise RunOver(status)

    trainer: subprocess.Popen | None = None
    trainer_log = log_dir / "trainer.log"
    try:
        ready = rendezvous.wait_model(stop_when_over)
        model_path = Path(ready.path)
        if not model_path.exists() and ready.name:
            # node 0 fetched a hub model into a cache this node does not share: fetch it here, once for the node
            try:
                model_path = fetch_model(ready.name)
            except ModelFetchError as e:
                rendezvous.fail(f"node {node.rank}: {e}")
                raise RuntimeError(str(e)) from None
        # node 0 made the run's key before saying the model is ready
        os.environ[API_KEY_ENV] = node_api_key(run_dir)
        host = advertised_host(cfg.engine.host, node.master_addr, node.master_port)
        print(plan.describe())
        rendezvous.engines_starting()
        engines = Engines(cfg, model_path, plan.engines, log_dir, advertise_host=host,
                          start_timeout_s=ready.start_timeout_s)

        def watch() -> None:
            """Report a dead engine or trainer process of this node to node 0 (which stops the run naming it),
            then stop here too; stop when node 0 says the run is over."""
            try:
                engines.check()
                code = trainer.poll() if trainer is not None else None
                if code not in (None, 0):  # 0: this share trained to the end; node 0 says when the run is over
                    raise ChildFailed(f"trainer exited with code {code}\n--- last lines of {trainer_log} ---\n"
                                      f"{tail(trainer_log)}")
            except RuntimeError as e:
                rendezvous.fail(str(e))
                raise
            stop_when_over()

        try:
            try:
                engines.wait_healthy()
            except RuntimeError as e:
                rendezvous.fail(str(e))
                raise
            rendezvous.publish_engines(engines.urls)
            print(f"node {node.rank}: engines {', '.join(engines.urls)} serve node 0; logs in {log_dir}")
            if plan.runs_trainer:
                port, urls = rendezvous.wait_trainer(watch)
                cmd = trainer_command(cfg, str(run_dir / "config.yaml"), ",".join(urls), len(plan.trainer_gpus),
                                      node.rank, node.master_addr, port)
                trainer = start_process(cmd, trainer_log, threads=cfg.trainer.threads, env=trainer_env(plan))
                print(f"node {node.rank}: trainer {plan.trainer_ranks} started, meeting node 0's at "
                      f"{node.master_addr}:{port}; log in {trainer_log}")
            (log_dir / "pids.json").write_text(json.dumps(engines.pids | ({"trainer": trainer.pid} if trainer else {})))
            while True:
                watch()
                time.sleep(0.5)
        except RunOver as over:
            if trainer is not None and over.status == "ok":
                # node 0's trainer processes are done, so this node's are past their last collective: let them
                # finish writing and exit on their own
                with contextlib.suppress(subprocess.TimeoutExpired):
                    trainer.wait(timeout=60)
            raise
        finally:
            if trainer is not None:
                stop_process(trainer)
            engines.stop()
    except RunOver as over:
        print(f"node {node.rank}: the run is over ({over.status}); its processes stopped")
        return 0 if over.status == "ok" else 1
    except (NodeLost, RuntimeError, TimeoutError) as e:
        print(f"pipelinerl: node {node.rank} failed: {e}", file=sys.stderr)
        return 1


def report(run_dir: Path) -> None:
    """Held-out accuracy before and after, the accuracy of the answers generated, the curves as PNG, where
    everything is."""
    from pipelinerl.plot import generated_accuracy, plot_runs, read_metrics

    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval_accuracy" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        print(f"held-out pass@1: {first['eval_accuracy']:.3f} at step {first['step']} -> "
              f"{last['eval_accuracy']:.3f} at step {last['step']} "
              f"({100 * (last['eval_accuracy'] - first['eval_accuracy']):+.1f} points)")
    generated = generated_accuracy(run_dir)
    if len(generated) >= 2:  # the policy's own accuracy: the trained batch's reward leaves dynamic sampling's drops out
        print(f"answers generated: {generated[0]['generated_accuracy']:.3f} right in the first window -> "
              f"{generated[-1]['generated_accuracy']:.3f} in the last (actor_metrics.jsonl, all groups, kept or "
              "dropped)")
    try:
        pngs = plot_runs([run_dir])
        print(f"curves: {', '.join(str(p) for p in pngs)}")
    except ValueError as e:
        print(f"no curves: {e}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}; final model: {run_dir / 'final_model'}; logs: {run_dir / 'logs'}")
