"""Keeping an engine's decoding apart from its weight transfers on a CPU machine.

On a GPU the decoding runs on the device and a weight update's transfer costs it little. On a CPU both are
CPU work: with few cores, the receiving threads (and the trainer's broadcast, when it shares the machine)
take turns with the decoding thread on the same cores, and an engine kept about 70% of its tokens/s while
updates arrived back to back (2 cores, `python -m bench --only engine_updates`). Given `--decode-cpus`, the
engine's decoding thread (and the torch threads it starts) runs on those cores only, and every other thread of
the server (HTTP, weight receiving, gloo's), and the weight-receiving process (receiving_process.py), on the others it
may use, so updates take the other cores' time, not the decoding's. With a receiving process the HTTP thread
runs on the decoding cores instead (serve.py says why).
"""

from __future__ import annotations

import os


class CpuListError(ValueError):
    """A CPU list that cannot be used on this machine; the message names `--decode-cpus`."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0', '0,2', '0-3,6' (the format of taskset and /sys) -> the set of CPU numbers."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise CpuListError(f"--decode-cpus {text!r}: expected CPU numbers like 0 or 0-3,6") from None
        if first < 0 or last < first:
            raise CpuListError(f"--decode-cpus {text!r}: {part!r} is not a range of CPU numbers")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise CpuListError(f"--decode-cpus {text!r}: no CPU given")
    return frozenset(cpus)


class CpuSplit:
    """Which CPUs the decoding thread and the transfer threads run on (both: `os.sched_getaffinity` of the
    process when no split is asked for)."""

    def __init__(self, decode_cpus: frozenset[int] | None = None):
        self.enabled = decode_cpus is not None
        if not self.enabled:
            return
        if not hasattr(os, "sched_setaffinity"):
            raise CpuListError("--decode-cpus: this platform cannot pin threads to CPUs (Linux only)")
        allowed = frozenset(os.sched_getaffinity(0))
        outside = sorted(decode_cpus - allowed)
        if outside:
            raise CpuListError(f"--decode-cpus: CPU(s) {outside} are not available to this process "
                               f"(it may use {_format(allowed)})")
        self.decode = decode_cpus
        # No CPU left over (e.g. --decode-cpus naming every allowed one): transfers share the decoding cores.
        self.transfer = (allowed - decode_cpus) or allowed

    def pin_decoding(self) -> None:
        """Call on the decoding thread (Linux pins the calling thread only)."""
        if self.enabled:
            os.sched_setaffinity(0, self.decode)

    def pin_transfer(self) -> None:
        """Call on the server's main thread before it starts threads, and on a thread that receives weights."""
        if self.enabled:
            os.sched_setaffinity(0, self.transfer)


def _format(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
