"""A pool of worker processes that score completions with a per-answer timeout and crash isolation.

Why processes: reward checks run third-party code (sympy via math-verify, user verifiers) that can hang, blow up
memory or segfault. In a separate process such a check costs one reward (0, with the reason recorded) and one
worker restart, never the actor. The workers are started with `spawn` (or `forkserver`) because the parent is
multi-threaded (asyncio actor, HTTP clients, this pool's own threads) and `fork` would copy held locks.

Design: one feeder thread per worker. It takes a job from a shared queue, sends it down the worker's pipe and waits
for the answers with a deadline per answer; on a timeout it kills the worker, on a dead pipe it reads the exit code,
and in both cases it starts a fresh worker and carries on. Callers get `concurrent.futures.Future`s, so a blocking
caller and an asyncio caller (`asyncio.wrap_future`, `score_async`) share one mechanism and the event loop never
blocks. A job is a batch of items (`score` and `score_async` split theirs into one batch per worker, at most
`MAX_BATCH` items each): one message down the pipe, one answer back per item, one future for the caller. Per item
that is what a job of one cost before, a third of the messages and none of the thread and event-loop wake-ups; on
small models the actor scores about 1,500 answers a second, and the round trips were a fifth of its CPU. A timeout
or crash costs the item it happened on; the batch's later items go to the fresh worker.

The scoring function travels by reference ("module:name"), so it must be a top-level function the worker can
import; it takes one plain dict and returns a float, `(float, parts)`, `(float, parts, info)` or a `RewardResult`.
An optional `fn.warmup()` attribute runs once per worker, outside the timeout (see `_worker_main`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from pipelinerl.plugins import import_ref
from pipelinerl.rewards.result import RewardResult

logger = logging.getLogger(__name__)

# a problem's own bound on its check, in seconds (a mix domain's `reward_timeout_s`): replaces the pool's timeout_s
TIMEOUT_KEY = "reward_timeout_s"
COUNTERS = ("scored", "timeouts", "crashes", "errors", "out_of_memory", "workers_replaced")
# the outcomes that cost the worker: it is killed (or gone) and a fresh one takes the batch's later items
WORKER_LOST = ("timeouts", "crashes", "out_of_memory")
MAX_BATCH = 16  # items in one job of `score` / `score_async`: larger batches balance badly over the workers
ScoreFn = Callable[[dict], Any] | str


def function_ref(fn: ScoreFn) -> str:
    """"module:name" of a top-level function: the only form a fresh worker process can import.

    Checked in the caller, so a lambda or closure fails at submit time with a clear message instead of as a
    pickling error inside a feeder thread.
    """
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"scoring function reference {fn!r} must look like 'package.module:function'")
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise ValueError(f"{fn!r} is not a top-level function: worker processes import the scoring function by "
                         "module and name, so lambdas, closures and methods cannot be used")
    return f"{module}:{name}"


def resolve(ref: str) -> Callable[[dict], Any]:
    """The scoring function at "module:name" (the project's one dotted-path loader, pipelinerl.plugins)."""
    return import_ref(ref, "scoring function")


def to_result(out: Any) -> RewardResult:
    """Normalise what a scoring function returned; a malformed or non-finite reward is an error, not a 0."""
    if isinstance(out, RewardResult):
        reward, parts, info = out.reward, out.parts, out.info
    elif isinstance(out, tuple) and len(out) in (2, 3):
        reward, parts, info = out[0], out[1], (out[2] if len(out) == 3 else "")
    else:
        reward, parts, info = out, {}, ""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"scoring function returned reward {reward!r}; expected a finite float")
    return RewardResult(float(reward), {str(k): float(v) for k, v in dict(parts).items()}, str(info))


def _exit_with_parent() -> None:
    """A worker stuck in a check would outlive a killed parent; a watchdog thread ends it instead."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _nothing() -> None:
    pass


def _limit_memory(limit_mb: int) -> None:
    """Let this worker's address space (RLIMIT_AS) grow by at most `limit_mb` MiB beyond what it holds now, with
    the scoring function imported and warmed up (libraries like torch map gigabytes of address space at import):
    a check that tries to take more gets a MemoryError (or dies), instead of the machine's memory and the OOM
    killer's choice of victim. Linux only; elsewhere the timeout still bounds the check."""
    if limit_mb <= 0:
        return
    try:
        import resource

        held = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):
        return
    limit = held + limit_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _worker_main(conn: Connection, preload: tuple[str, ...], memory_limit_mb: int = 0) -> None:
    """Worker loop: receive (ref, items), run the function on each item in order, send each result.

    Before the first check with a function this worker has not imported, it imports it, runs its warm-up and
    says "start": the parent excludes import time (sympy takes seconds on a cold process) from the per-answer
    timeout; a scoring function may carry a `warmup` attribute, a no-argument callable run once per worker before
    its first check. Checks run in this process's main thread, so signal-based timeouts work.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it closes the pool
    _exit_with_parent()
    limited = False
    functions: dict[str, Callable[[dict], Any]] = {}
    for name in preload:  # a module, or a scoring function ("module:function") to import and warm up now
        try:
            if ":" in name:
                fn = resolve(name)
                getattr(fn, "warmup", _nothing)()
                functions[name] = fn
            else:
                importlib.import_module(name)
        except Exception as e:  # the job that needs it will report the error
            logger.warning("reward worker could not preload %s: %s", name, e)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ref, items = msg
        items.reverse()  # popped from the end: each item is let go as soon as it is scored
        while items:
            item = items.pop()
            try:
                if ref not in functions:
                    fn = resolve(ref)
                    getattr(fn, "warmup", _nothing)()  # heavy imports, before the clock starts
                    functions[ref] = fn
                    conn.send(("start", None))
                if not limited:  # once the first function is imported: the cap is on what the checks take
                    _limit_memory(memory_limit_mb)
                    limited = True
                reply = ("ok", to_result(functions[ref](item)))
            except MemoryError:
                reply = ("memory", f"the check needed more than the {memory_limit_mb} MiB a worker may take "
                                   "(reward.memory_limit_mb)")
            except Exception as e:
                reply = ("error", f"{type(e).__name__}: {e}")
            del item  # a big completion is not kept while the worker waits for the next one
            conn.send(reply)
            if reply[0] == "memory":
                return  # a fresh worker, with a clean heap, takes the next check (the parent resends the rest)


class RewardPool:
    """N worker processes scoring items with `fn(item)`; see the module docstring.

    Use as a context manager (or call `start()` / `close()`). `score` blocks; `score_async` awaits without
    blocking the event loop; `submit` returns a `concurrent.futures.Future[RewardResult]`. A failed check gives
    `RewardResult(0.0, {}, reason)` with reason "timeout: ...", "crash: exit code N" or "error: Type: message".
    Counters (`stats()`): scored (checks that returned a reward), timeouts, crashes, errors, workers_replaced.

    `timeout_s` bounds each check from the moment the worker starts it (an item whose problem carries
    `reward_timeout_s`, a mix domain's own, gets that bound instead: `check_timeout`); `start_timeout_s` separately
    bounds a fresh worker's start-up, the import of the scoring function and its warmup. `preload` names modules
    every worker imports as soon as it starts, and scoring functions ("module:function") it imports and warms up
    then: the functions a scoring function calls in turn (a mix's domains) would otherwise warm up inside the clock.
    `memory_limit_mb` caps how far each worker's address space may grow beyond its imports (0: no cap); a check that
    runs out gets reward 0 with reason "out of memory: ...", counted in `out_of_memory`, and its worker is replaced.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 5.0, start_method: str = "spawn",
                 preload: Iterable[str] = (), start_timeout_s: float = 120.0, memory_limit_mb: int = 0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be spawn or forkserver (the parent has threads), got {start_method!r}")
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self.preload = tuple(preload)
        self.memory_limit_mb = memory_limit_mb
        self._ctx = mp.get_context(start_method)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._procs: list[tuple[Any, Connection] | None] = [None] * workers
        # the scoring functions each slot's current worker has imported: its checks of them start at once, with no
        # "start" message (a fresh worker has none)
        self._loaded: list[set[str]] = [set() for _ in range(workers)]
        self._threads: list[threading.Thread] = []
        self._started = self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> RewardPool:
        with self._lock:
            if self._started:
                return self
            self._started = True
        for slot in range(self.workers):
            self._procs[slot] = self._spawn(slot)
        for slot in range(self.workers):
            thread = threading.Thread(target=self._feed, args=(slot,), name=f"reward-feeder-{slot}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop the workers. Queued jobs are cancelled; jobs in flight fail with RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                job[2].cancel()
            for _ in self._threads:
                self._jobs.put(None)
        for entry in self._procs:
            if entry is not None:
                entry[0].kill()  # interrupts checks in flight; idle workers would stop on the sentinel anyway
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring -----------------------------------------------------------------------------------------------

    def submit(self, fn: ScoreFn, item: dict) -> concurrent.futures.Future:
        """Score one item: a future of its `RewardResult`."""
        return self._submit(function_ref(fn), [item], single=True)

    def submit_batch(self, fn: ScoreFn, items: list[dict]) -> concurrent.futures.Future:
        """Score `items` on one worker, in order: a future of their `RewardResult`s (see the module docstring)."""
        return self._submit(function_ref(fn), list(items), single=False)

    def score(self, fn: ScoreFn, items: Iterable[dict]) -> list[RewardResult]:
        futures = [self.submit_batch(fn, batch) for batch in self._batches(items)]
        return [r for f in futures for r in f.result()]

    async def score_async(self, fn: ScoreFn, items: Iterable[dict]) -> list[RewardResult]:
        futures = [asyncio.wrap_future(self.submit_batch(fn, batch)) for batch in self._batches(items)]
        return [r for batch in await asyncio.gather(*futures) for r in batch]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # -- internals ---------------------------------------------------------------------------------------------

    def _submit(self, ref: str, items: list[dict], single: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or not self._started:
                raise RuntimeError("reward pool is not running (use it as a context manager or call start())")
            self._jobs.put((ref, items, future, single))
        return future

    def _batches(self, items: Iterable[dict]) -> list[list[dict]]:
        """`items` in one batch per worker (so that the workers share them), of at most MAX_BATCH items."""
        items = list(items)
        size = min(MAX_BATCH, max(1, -(-len(items) // self.workers)))
        return [items[i:i + size] for i in range(0, len(items), size)]

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _spawn(self, slot: int) -> tuple[Any, Connection]:
        parent_end, child_end = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child_end, self.preload, self.memory_limit_mb),
                                 name=f"reward-worker-{slot}", daemon=True)
        proc.start()
        child_end.close()  # so the parent sees EOF when the worker dies
        return proc, parent_end

    def _feed(self, slot: int) -> None:
        while (job := self._jobs.get()) is not None:
            ref, items, future, single = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                results = self._score_on(slot, ref, items)
                future.set_result(results[0] if single else results)
            except Exception as e:  # pool closing, or a failed respawn: fail this job, keep the feeder alive
                future.set_exception(e)
        _stop(*self._procs[slot], kill=False)

    def _score_on(self, slot: int, ref: str, items: list[dict]) -> list[RewardResult]:
        """Every item's result, in order. A check that times out, crashes or runs out of memory costs its own item
        and its worker; the items after it go to the fresh worker."""
        results: list[RewardResult] = []
        while len(results) < len(items):
            proc, conn = self._procs[slot]
            for result, outcome in self._run(proc, conn, ref, items[len(results):], self._loaded[slot]):
                results.append(result)
                self._count(outcome)
                if outcome in WORKER_LOST:
                    _stop(proc, conn, kill=True)
                    if self._closed:
                        raise RuntimeError("reward pool closed while the check was running")
                    logger.warning("reward worker %d replaced after %s", slot, result.info)
                    self._procs[slot] = self._spawn(slot)
                    self._loaded[slot] = set()
                    self._count("workers_replaced")
                    break  # the rest of the batch, if any, on the fresh worker
        return results

    def _run(self, proc: Any, conn: Connection, ref: str, items: list[dict], loaded: set[str]
             ) -> Iterator[tuple[RewardResult, str]]:
        """A batch on one worker: (result, counter name) per item, in order, up to the first that costs the worker
        (timeout, crash, out of memory). Each check's deadline starts when the one before it answered, or, for a
        function the worker has yet to import, when the worker says "start"."""
        try:
            conn.send((ref, items))
        except (OSError, EOFError):  # the worker died while idle
            yield _crashed(proc), "crashes"
            return
        except Exception:  # an item could not be pickled; nothing reached the worker
            yield from self._unpicklable(proc, conn, ref, items, loaded)
            return
        for item in items:
            limit = check_timeout(item, self.timeout_s)
            started = ref in loaded
            deadline = time.monotonic() + (limit if started else self.start_timeout_s)
            while True:
                remaining = deadline - time.monotonic()
                if not conn.poll(max(remaining, 0.0)):  # past the deadline, still take a result already sent
                    what = f"no result within {limit:g} s" if started else \
                        f"the worker did not start the check within {self.start_timeout_s:g} s"
                    yield RewardResult(0.0, {}, f"timeout: {what}"), "timeouts"
                    return
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    yield _crashed(proc), "crashes"
                    return
                if kind != "start":
                    break
                loaded.add(ref)
                started, deadline = True, time.monotonic() + limit
            if kind == "ok":
                yield value, "scored"
            elif kind == "memory":
                yield RewardResult(0.0, {}, f"out of memory: {value}"), "out_of_memory"
                return
            else:
                yield RewardResult(0.0, {}, f"error: {value}"), "errors"

    def _unpicklable(self, proc: Any, conn: Connection, ref: str, items: list[dict], loaded: set[str]
                     ) -> Iterator[tuple[RewardResult, str]]:
        """A batch that could not be sent: each item that cannot be pickled is an error, the others are scored."""
        for item in items:
            try:
                ForkingPickler.dumps(item)  # what Connection.send pickles with
            except Exception as e:
                yield RewardResult(0.0, {}, f"error: cannot send item: {type(e).__name__}: {e}"), "errors"
                continue
            for result in self._run(proc, conn, ref, [item], loaded):
                yield result
                if result[1] in WORKER_LOST:
                    return


def check_timeout(item: dict, default: float) -> float:
    """The seconds `item`'s check may take: its problem's own `reward_timeout_s` where it has one, else `default`."""
    problem = item.get("problem") if isinstance(item, dict) else None
    own = problem.get(TIMEOUT_KEY) if isinstance(problem, dict) else None
    return float(own) if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0 else default


def _crashed(proc: Any) -> RewardResult:
    proc.join(timeout=5.0)
    return RewardResult(0.0, {}, f"crash: exit code {proc.exitcode}")


def _stop(proc: Any, conn: Connection, kill: bool) -> None:
    if not kill:
        try:
            conn.send(None)
        except (OSError, EOFError, ValueError):
            pass
        proc.join(timeout=2.0)
    if proc.is_alive():
        proc.kill()
    proc.join()
    conn.close()
