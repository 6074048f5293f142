"""The engine supervisor: the engine processes of one node, started, waited for until healthy, restarted when one
dies (up to `engine.max_restarts`), and stopped; with the deadline they are given to start."""

from __future__ import annotations

import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

from pipelinerl.config import ConfigError, EngineConfig, RunConfig
from pipelinerl.contracts.engine import engine_kind
from pipelinerl.engines.client import EngineClient
from pipelinerl.launch.children import ChildFailed, ProcessSpec
from pipelinerl.placement import EngineSlot
from pipelinerl.procs import engine_command, start_process, stop_process, stop_processes, tail, wait_for_port


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
                 advertise_host: str | None = None, start_timeout_s: float = 900.0) -> None:
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


def gpu_memory_args(e: EngineConfig) -> dict[str, str]:
    """The engine's share of its GPU (`engine.gpu_memory_utilization`) in the words of the engine it starts,
    ahead of any arguments the user gives in the same environment variable (so the user's win)."""
    flag = engine_kind(e.kind).gpu_memory_flag
    if flag is None:
        return {}
    var, flag = flag
    return {var: f"{flag} {e.gpu_memory_utilization} {os.environ.get(var, '')}".strip()}


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
