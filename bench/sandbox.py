"""What the code-reward sandbox (pipelinerl/sandbox/) costs per program: `python -m bench.sandbox
[--quick] [--programs N] [--repeats N]`.

Measured on this machine's cores, with a trivial program (`pass`), so the numbers are the sandbox's own cost:
- per-program wall time, the median of REPEATS runs of each side, interleaved round by round (drift in the
  machine's speed hits every side alike):
  - `run_python` as this machine isolates it (`isolation()`: namespaces, private tmpfs, a uid of its own);
  - the same harness without the private tmpfs (namespaces --net --pid --ipc only), and without the namespace
    wrapper at all (no `unshare`; a separate user only, where root);
  - a bare `subprocess.run([python, "-I", "-c", "pass"])`, the interpreter start any sandbox pays at least, and
    `python -I -S -c pass`, the same without `site` (the harness skips `site`: its .pth files are most of a
    start here), the floor for this design;
  with the CPU time of the started processes (RUSAGE_CHILDREN) and of the calling process next to it: steadier
  than wall time where other work shares the cores;
- throughput: PROGRAMS trivial programs through `run_python` from a ThreadPool of os.cpu_count() workers, in
  programs per second, against as many bare `python -I -c pass` subprocesses from the same pool.
ratio = bare `python -I -c pass` median / sandboxed median; target 1.0: a sandboxed run should cost no more than
starting a plain isolated interpreter.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import format_table, interleaved, machine, median, verdict
from pipelinerl import sandbox
from pipelinerl.sandbox import SandboxLimits, isolation, run_python

NAME = "sandbox"
TARGET = 1.0
REPEATS, QUICK_REPEATS = 50, 15
PROGRAMS, QUICK_PROGRAMS = 200, 60
LIMITS = SandboxLimits(wall_s=30.0)  # generous: a busy machine must not turn a trivial run into a timeout
BARE = [sys.executable, "-I", "-c", "pass"]
BARE_NO_SITE = [sys.executable, "-I", "-S", "-c", "pass"]


def _sandboxed(mode: sandbox._Mode | None = None):
    def run() -> None:
        result = (run_python("pass", "", LIMITS) if mode is None
                  else sandbox._execute("pass", "", LIMITS, None, [], mode))
        if not result.ok:
            raise RuntimeError(f"trivial program failed in the sandbox: {result}")
    return run


def _bare(cmd: list[str]):
    def run() -> None:
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return run


class ChildCpu:
    """Calling it calls `fn` and records the CPU seconds of the processes it waited for (RUSAGE_CHILDREN; the
    calls are sequential, so the difference is that call's): on a busy shared machine wall time moves with the
    load, CPU time much less."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self) -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.fn()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.seconds.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def _throughput(fn, programs: int, workers: int) -> float:
    """Programs per second with `workers` threads each running `fn` back to back."""
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: fn(), range(workers)))  # warm the threads (and the sandbox's probe)
        t0 = time.perf_counter()
        list(pool.map(lambda _: fn(), range(programs)))
        return programs / (time.perf_counter() - t0)


def run(quick: bool = False, repeats: int | None = None, programs: int | None = None) -> dict:
    """Measure every side; returns the JSON-able result."""
    repeats = repeats or (QUICK_REPEATS if quick else REPEATS)
    programs = programs or (QUICK_PROGRAMS if quick else PROGRAMS)
    workers = os.cpu_count() or 1
    isolated = isolation()
    sides = {"sandbox": _sandboxed(), "bare python -I": _bare(BARE), "bare python -I -S": _bare(BARE_NO_SITE)}
    mode = sandbox._detect_mode()
    if mode.private_tmp:  # what the mount namespace, its tmpfs and ctypes (to mount them) add
        sides["sandbox, no private tmp"] = _sandboxed(sandbox._Mode(mode.unshare, ("--net", "--pid", "--ipc"),
                                                                    separate_user=mode.separate_user))
    if mode.namespaces:
        sides["sandbox, no namespaces"] = _sandboxed(sandbox._Mode(None, separate_user=mode.separate_user))
    sides = {name: ChildCpu(fn) for name, fn in sides.items()}
    wall, parent_cpu = interleaved(sides, repeats, warmup=2)
    ms = {name: round(median(times) * 1000, 2) for name, times in wall.items()}
    cpu_ms = {name: {"children": round(median(side.seconds[-repeats:]) * 1000, 2),
                     "caller": round(median(parent_cpu[name]) * 1000, 2)} for name, side in sides.items()}
    per_second = {"sandbox": round(_throughput(sides["sandbox"], programs, workers), 1),
                  "bare python -I": round(_throughput(sides["bare python -I"], programs, workers), 1)}
    ratio = ms["bare python -I"] / ms["sandbox"]
    return {
        "name": NAME,
        **verdict(ratio, TARGET),
        "ratio_is": "bare `python -I -c pass` / sandboxed `pass`, median wall ms per program",
        "summary": (f"sandboxed trivial program {ms['sandbox']:.1f} ms vs bare python -I {ms['bare python -I']:.1f} ms;"
                    f" {per_second['sandbox']:.0f} programs/s on {workers} workers"),
        "median_ms": ms,
        "median_cpu_ms": cpu_ms,
        "overhead_ms_vs_bare_no_site": round(ms["sandbox"] - ms["bare python -I -S"], 2),
        "programs_per_second": per_second,
        "isolation": isolated,
        "settings": {"repeats": repeats, "programs": programs, "workers": workers, "program": "pass",
                     "statistic": "median of interleaved rounds"},
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} repeats, {QUICK_PROGRAMS} programs")
    parser.add_argument("--repeats", type=int, default=None, help=f"runs per side for the medians ({REPEATS})")
    parser.add_argument("--programs", type=int, default=None, help=f"programs for the throughput ({PROGRAMS})")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, repeats=args.repeats, programs=args.programs)
    m = result["machine"]
    print(f"cpu: {m['cpu']}, {m['cores']} cores, load {m['load_average_1m']}; isolation: {result['isolation']}")
    floor = result["median_ms"]["bare python -I -S"]
    rows = [[name, f"{value:.2f}", f"{value - floor:+.2f}", f"{result['median_cpu_ms'][name]['children']:.2f}",
             f"{result['median_cpu_ms'][name]['caller']:.2f}", f"{result['programs_per_second'].get(name, '')}"]
            for name, value in result["median_ms"].items()]
    print(format_table(rows, ["side", "wall ms", "vs python -I -S", "child CPU ms", "caller CPU ms", "programs/s"]))
    print(f"ratio {result['ratio']:.3g} (target {result['target']:g}): {result['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
