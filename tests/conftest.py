import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from pipelinerl.engines.client import EngineClient
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.procs import engine_command, start_process, stop_process, tail, wait_for_port


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with sharp (non-uniform) next-token distributions, so greedy ties are unlikely."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2,
                            initializer_range=0.2, seed=1234)


_engine_numbers = itertools.count()


@contextlib.contextmanager
def running_engine(model_dir, log_dir: Path, extra=(), threads: int = 1):
    # port 0 + --port-file: the engine binds a free port itself, so no other process can take it in between
    name = f"engine-{next(_engine_numbers)}"
    log, port_file = log_dir / f"{name}.log", log_dir / f"{name}.port"
    cmd = engine_command(str(model_dir), 0, extra=[*extra, "--port-file", str(port_file)])
    proc: subprocess.Popen = start_process(cmd, log, threads=threads)
    client = None
    try:
        try:
            client = EngineClient(f"http://127.0.0.1:{wait_for_port(port_file, proc, 120)}")
            client.wait_healthy(timeout_s=120, process=proc)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- engine log ---\n{tail(log)}") from e
        client.log_path = log
        client.process = proc
        yield client
    finally:
        if client is not None:
            client.close()
        stop_process(proc)


def run_cli(args: list[str], timeout_s: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """`pipelinerl ARGS` in a new process, its output captured. Past `timeout_s` the test fails with the stacks of
    every thread of the process (faulthandler, on SIGABRT) instead of a bare timeout: a command that should refuse
    in seconds once hung for 120 s in a full `make test`, and never again alone."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        dump = err[err.find("Fatal Python error"):]  # innermost frame first: the top says where it hung
        pytest.fail(f"pipelinerl {' '.join(args)}: still running after {timeout_s:g} s; its threads:\n{dump[:6000]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(poll_s)


def records_from_child(reader, child, n: int) -> list:
    """What `reader` reads until `n` records arrived or the writing `child` process exited (its last records read
    after it exited). No idle timeout: a spawned child re-imports its modules first, which took over 30 s once
    under `make test`'s load; a child that dies fails the test at once, one that hangs at pytest's timeout."""
    got: list = []
    while len(got) < n:
        alive = child.is_alive()
        got += reader.read()
        if not alive:
            break
        time.sleep(0.05)
    return got


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each of schemathesis' per-operation items (tests/test_fuzz.py) a node id of its own.

    On pytest 9.2 they all get their test function's node id (pytest now builds an item's id from `originalname`,
    which schemathesis sets to the bare function name), and pytest-xdist, which reports by node id, then ran one
    item of each set. The operation becomes the id's parameter part, as `pytest.mark.parametrize` would make it.
    Any id still shared afterwards stops the run: under xdist it would silently drop tests."""
    counts = Counter(item.nodeid for item in items)
    for item in items:
        label = getattr(item, "operation_label", None)
        if counts[item.nodeid] > 1 and label and getattr(item, "_id", None) is not None and item._id.params is None:
            item._id = item._id.with_params(label)
    shared = sorted(nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1)
    if shared:
        raise pytest.UsageError(f"tests share node ids, so pytest-xdist would run only one of each: {shared[:5]}")
    items[:] = files_in_run_order(items)


# `make test` hands test files to its two pytest-xdist workers in collection order (`--no-loadscope-reorder`).
# xdist's own order, the files with the most tests first, starts these one-test files last: in a fresh clone's run
# (TEST_TIMELINE, docs/benchmarks_history.md) the ORZ rehearsal (253 s) then ran while the other worker sat idle
# for 234 s.
# Only this file goes first: started together, it and the tiny recipe slowed each other (an earlier trial).
RUN_FIRST = ("test_orz_rehearsal.py",)


def files_in_run_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """RUN_FIRST's files, then the others in xdist's own order (most tests first, ties as collected); each file's
    tests together and in their own order. Order only changes wall time, never what runs."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    files = sorted(by_file, key=lambda f: (Path(f).name not in RUN_FIRST, -len(by_file[f])))
    return [item for f in files for item in by_file[f]]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With TEST_TIMELINE=<file>, append one line per test: start and end (wall clock, s), worker, node id. It
    shows where the workers of `make test` wait on each other (the test suite's section in docs/benchmarks.md)."""
    path = os.environ.get("TEST_TIMELINE")
    start = time.time()
    try:
        return (yield)
    finally:
        if path:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with open(path, "a") as f:
                f.write(f"{start:.1f} {time.time():.1f} {worker} {item.nodeid}\n")
