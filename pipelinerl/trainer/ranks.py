"""Trainer processes waiting for one another on the host, outside the collectives of their process group.

Only the main trainer process talks to the engines, evaluates on the held-out set and writes the files one
process writes (a checkpoint's KL reference and state, the Hugging Face export). Meanwhile the other processes
must not wait inside a collective of the trainer's process group: a collective is bounded by the group's timeout
(`trainer.collective_timeout_s`; NCCL's watchdog ends the process when it runs out), and a held-out evaluation of
8k-token answers outlasts any timeout short enough to catch a real hang. So every rank meets at a barrier of a
gloo group made for this alone: host memory and TCP, no GPU stream, no watchdog, its own timeout
(`trainer.main_process_timeout_s`). A main process that never comes is still reported, naming the key.

`open_host_barrier` is called once by every trainer process right after the trainer's process group exists
(`make_accelerator`), `host_barrier` wherever the processes must meet after work that is not shared evenly, and
`close_host_barrier` before the process group is destroyed (`Trainer.close`).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

_group: dist.ProcessGroup | None = None
_timeout = timedelta(0)


class TrainerRankLost(RuntimeError):
    """A trainer process did not reach a host barrier within `trainer.main_process_timeout_s`."""


def open_host_barrier(timeout_s: float) -> None:
    """Make the gloo group of the host barrier. Collective: every trainer process calls it once, at the same point,
    after the trainer's process group is initialised; a no-op for a single process."""
    global _group, _timeout
    if _group is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _timeout = timedelta(seconds=timeout_s)
    _group = dist.new_group(backend="gloo", timeout=_timeout)


def host_barrier(after: str) -> None:
    """Wait, outside any collective of the trainer's process group, until every trainer process got here. `after`
    says what the processes were doing (held-out evaluation, checkpoint files...), for the error.

    Raises TrainerRankLost when some process does not come within `trainer.main_process_timeout_s`: it died (the
    launcher usually stops the others first) or hangs. Without `open_host_barrier` (a trainer built around an
    accelerator of the caller's), the trainer's own group holds the barrier."""
    if _group is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return
    try:
        dist.monitored_barrier(group=_group, timeout=_timeout, wait_all_ranks=True)
    except RuntimeError as e:
        rank, detail = dist.get_rank(), str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        who = ("the main trainer process" if rank else "some trainer process")
        raise TrainerRankLost(
            f"trainer process {rank} waited {_timeout.total_seconds():g} s after {after} and {who} did not come "
            f"(trainer.main_process_timeout_s): it died or hangs, its lines in the trainer log say which; raise "
            f"trainer.main_process_timeout_s if {after} takes longer than that. ({detail})") from e


def close_host_barrier() -> None:
    """Destroy the host barrier's group (before the trainer's process group is destroyed)."""
    global _group
    if _group is None:
        return
    group, _group = _group, None
    try:
        dist.destroy_process_group(group)
    except Exception as e:  # the run is over either way; a peer that already left can make this fail
        log.warning("destroying the trainer's host-barrier group: %s", e)
