"""Starting and stopping the processes of a run: free ports, engine servers, clean shutdown."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# the actor's exit code when every training problem was retired as solved (actor.retire_solved): the launcher ends
# the run there, as a success
POOL_SOLVED_EXIT = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_command(model: str, port: int, host: str = "127.0.0.1", engine: str = "embedded",
                   extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pipelinerl.cli", "serve", "--engine", engine, "--model", str(model),
            "--host", host, "--port", str(port), *extra]


def die_with_parent() -> None:
    """Called first thing by every role started through `start_process` (it sets PIPELINERL_DIE_WITH_PARENT):
    on Linux, ask the kernel to SIGTERM this process when its parent dies, so a launcher that is killed outright
    leaves no orphans behind."""
    if os.environ.get("PIPELINERL_DIE_WITH_PARENT") != "1" or sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_in_child(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a fresh (spawned) Python process, waited for; its result returned and its exception raised
    here. For work whose process-wide state must not stay in this one (a CUDA context)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def start_process(cmd: Sequence[str], log_path: str | Path, threads: int | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child in its own process group with output to `log_path`; thread counts pinned when given."""
    full_env = {**os.environ, **(env or {}), "PIPELINERL_DIE_WITH_PARENT": "1"}
    if threads:
        full_env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout_s)


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """`stop_process` for several children at once: SIGTERM to every process group, then one shared wait of
    `timeout_s`, then SIGKILL for what lingers. Eight engines that each ignore SIGTERM cost `timeout_s`, not eight
    times it."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)


def wait_for_port(port_file: str | Path, proc: subprocess.Popen, timeout_s: float,
                  check: Callable[[], None] | None = None) -> int:
    """The port a server started with `--port-file` reports once it listens; raises if it exits or times out, or
    what `check` (called while waiting) raises."""
    path, deadline = Path(port_file), time.monotonic() + timeout_s
    while not path.exists():
        if check is not None:
            check()
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not listening after {timeout_s:g}s")
        time.sleep(0.1)
    return int(path.read_text())


def tail(path: str | Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def role_arguments(role: str, description: str, argv: list[str] | None = None):
    """The command line every pipeline role takes (`CONFIG --engines URL[,URL]`), parsed; also sets up what a
    child of the launcher needs first: dying with its parent and log lines tagged with the role."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog=f"python -m pipelinerl.{role}", description=description)
    parser.add_argument("config", help="the run's resolved config.yaml")
    parser.add_argument("--engines", required=True,
                        help="comma-separated engine URLs, or @FILE: a file of them that the launcher writes once "
                             "every engine answers (see engine_urls)")
    args = parser.parse_args(argv)
    die_with_parent()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.basicConfig(level="INFO", format=f"%(asctime)s {role} %(levelname)s %(message)s")
    return args


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), imports included; None elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def write_engine_urls(path: Path, urls: Sequence[str]) -> None:
    """Tell the roles waiting on `--engines @path` where the engines are (written whole: a reader never sees part)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(",".join(urls))
    tmp.replace(path)


def engine_urls(spec: str, should_stop: Callable[[], bool] = lambda: False, timeout_s: float = 900.0
                ) -> list[str] | None:
    """The engines a role talks to, from its `--engines` argument: comma-separated URLs, or `@FILE`. With a file
    the launcher starts the role while the engines load their models, so that the role imports and loads its own
    meanwhile, and writes the file when every engine answers; this waits for it. None when `should_stop` says so
    first; TimeoutError after `timeout_s`."""
    if not spec.startswith("@"):
        return spec.split(",")
    path = Path(spec[1:])
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if should_stop():
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no engine URLs in {path} after {timeout_s:.0f} s: the launcher writes them when "
                               "every engine answers (see the engine logs beside this one)")
        time.sleep(0.05)
    return path.read_text().split(",")


def tool_command(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS` for a third-party launcher (torchrun, accelerate) that should die with the
    launcher like our own roles do: it goes through this module, which sets that up and then runs MODULE."""
    return [sys.executable, "-m", "pipelinerl.procs", module, *args]


if __name__ == "__main__":
    import runpy

    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
