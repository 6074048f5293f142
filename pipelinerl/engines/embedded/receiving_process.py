"""Receiving weight updates in a process of its own, beside a CPU engine's decoding.

Why: received on a thread of the engine's process, an update's Python (planning where each tensor lands,
starting each broadcast, copying and transposing each bucket as it arrives) takes the GIL that the decoding
thread needs between its torch calls. On 2 CPUs the decoding thread got 0.96 of its core while updates
arrived back to back (`python -m bench --only engine_updates`); a process that only received the same bytes
on the same core cost decoding nothing measurable. So on CPU the engine's weights live in shared memory and
this process does everything an update needs except the switch:

- it holds the spare side (`SpareWeights` over its own views of the same memory, every allocation shared) and
  the rotation of the runner's transposed copies (`CopyBook`);
- it joins the weight-update group, receives each update into spare memory and builds the transposed copies
  of the new weights as they arrive;
- it answers with where the new weights lie (`Received`: storages by number, memory by `Ref`); the engine
  points its weights there at its next step boundary (`SpareWeights.take_spares`, then its usual `switch`);
- it then mirrors that switch in its own bookkeeping (no byte copied), so both agree on which memory is live,
  and it never writes memory the engine is reading: the next update starts only after the engine switched.

The engine talks to it through `ReceivingProcess` (one call at a time, over a pipe, awaited on the server's
event loop; shared tensors travel as file descriptors, each storage once), driven by update_receivers.py's
`ProcessReceiver`. A process that dies is replaced and counted there; the group it was in is lost with it, so
the trainer must ask the engine to join again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from pipelinerl.engines.embedded.spare_weights import SpareWeights
from pipelinerl.engines.embedded.transpose import UpdateCopies, relayout_copier
from pipelinerl.weight_sync import (
    TensorSpec,
    WeightSyncError,
    WeightUpdateGroup,
    join_weight_update_group,
    receive_tensors,
)

log = logging.getLogger(__name__)
# Shared memory needed, in multiples of the weights' bytes: the live weights, two arenas of a bucketed update,
# spares of the weights no arena can hold in place; and as much again as the runner's copies of the weights
# (transposed or packed) take, for those being built.
SHARED_MEMORY_FACTOR = 4
SHARED_MEMORY_DIR = "/dev/shm"


def shared_memory_shortfall(weight_bytes: int, copy_bytes: int | None = None,
                            directory: str = SHARED_MEMORY_DIR) -> str | None:
    """Why receiving in a process cannot be used here (too little shared memory for weights of `weight_bytes`
    whose copies in the runner's layouts take `copy_bytes`; default as many as the weights), or None. Shared
    tensors live in `directory` (a tmpfs); running out of it mid-update would kill the process that touches the
    missing page (SIGBUS), so it is checked up front. Docker gives containers 64 MB unless started with
    --shm-size."""
    if not os.path.isdir(directory):
        return None  # not Linux's layout: nothing to check against
    stats = os.statvfs(directory)
    copies = weight_bytes if copy_bytes is None else copy_bytes
    free, need = stats.f_bavail * stats.f_frsize, SHARED_MEMORY_FACTOR * weight_bytes + copies
    if free >= need:
        return None
    return (f"receiving updates in a process keeps the weights in shared memory: it needs about "
            f"{need / 2**20:.0f} MiB of {directory}, which has {free / 2**20:.0f} MiB free (in Docker, start the "
            "container with a larger --shm-size)")


@dataclass(frozen=True)
class Ref:
    """A tensor in shared memory, by the number of its storage (`Received.new`) and its place in it."""

    key: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Received:
    """The answer to an update: when its last byte arrived (`time.perf_counter`, which is system-wide), where
    each storage it changes now holds the new values (storage number -> Ref); the relayout slots whose weights
    it changes, the transposed copies built of them (slot -> Ref: all but `stale` when asked to, none
    otherwise), `stale`: those it changes in place so that no copy can be built before the switch (a fused
    weight updated in part); the seconds spent copying; the storages the engine has not been sent yet."""

    last_byte: float
    spares: dict[int, Ref] | None
    slots: list[int]
    copies: dict[int, Ref] | None
    stale: list[int]
    copy_seconds: float
    # The number of this (spares, copies): sent once, then only by number (updates take turns between a few)
    layout: int = 0
    new: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Setup:
    """What the process starts from: the engine's parameters (name -> tensor, tied names included), its fused
    buffers (`SlotRunner.fused_groups`) and the live weight of each relayout slot, all in shared memory and
    sent in one message, so that a parameter that is a view of a fused buffer stays one there too."""

    params: dict[str, torch.Tensor]
    fused_groups: list
    slot_weights: list[torch.Tensor]
    cpus: list[int] | None = None
    slot_layouts: list[str] | None = None  # the layout of each relayout slot's copies (default: transposed)


class ReceiverDied(RuntimeError):
    """The receiving process exited; the engine replaces it."""


class CopyBook:
    """The receiving process's side of the runner's transposed (or packed) copies (slot_runner.py): the live
    weight and the copies' layout of each relayout slot, and the copies to write the next ones into. A copy the
    engine takes into use retires the one before it; this process writes only into retired copies (or new
    memory), never into the copy in use. Which the engine uses is known here from the copies it was sent: the
    engine may also multiply by the live weight itself, or by a copy of its own (a fused weight updated in
    part), which this process never writes."""

    def __init__(self, slot_weights: list[torch.Tensor], slot_layouts: list[str] | None = None):
        self.relayout_slots = [(None, "", w) for w in slot_weights]  # the shape UpdateCopies reads
        self.layouts = slot_layouts or ["transposed"] * len(slot_weights)  # SlotRunner.relayout_layouts
        self._current: dict[int, torch.Tensor] = {}
        self._retired: dict[int, torch.Tensor] = {}

    def copy_plans(self, sources: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, object]]:
        return {slot: relayout_copier(self.layouts[slot], src, out=self._retired.pop(slot, None), shared=True)
                for slot, src in sources.items()}

    def use(self, copies: dict[int, torch.Tensor]) -> None:
        for slot, copy in copies.items():
            if slot in self._current:
                self._retired[slot] = self._current[slot]
            self._current[slot] = copy


class _Names:
    """Numbers for the storages this process refers the engine to; each storage is sent once (`take_new`).
    Every storage named is kept, so that no other can take its address and be mistaken for it: a few per
    update layout (its arenas, the spares), which a run changes rarely if ever."""

    def __init__(self) -> None:
        self._keys: dict[int, int] = {}  # storage address here -> key
        self._kept: list[torch.Tensor] = []
        self._new: dict[int, torch.Tensor] = {}

    def ref(self, t: torch.Tensor) -> Ref:
        storage = t.untyped_storage()
        key = self._keys.get(storage.data_ptr())
        if key is None:
            if not storage.is_shared():
                raise RuntimeError("a tensor the engine must see is not in shared memory")
            key = self._keys[storage.data_ptr()] = len(self._kept)
            self._kept.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            self._new[key] = self._kept[-1]
        return Ref(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def take_new(self) -> dict[int, torch.Tensor]:
        new, self._new = self._new, {}
        return new


class _Process:
    """The receiving process's state and commands (run by `_main`)."""

    def __init__(self, setup: Setup):
        self.spare = SpareWeights(setup.params, setup.fused_groups, shared=True)
        self.book = CopyBook(setup.slot_weights, setup.slot_layouts)
        self.names = _Names()
        self.layouts: dict[tuple, int] = {}
        self.group: WeightUpdateGroup | None = None
        self._bare: list[torch.Tensor] = []

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
             group_name: str, timeout_s: float) -> None:
        self.leave()
        self.group = join_weight_update_group(master_address, master_port, rank, world_size, backend, group_name,
                                              timeout_s)

    def leave(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def drain(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        """Take part in an update the engine refused, writing nothing that the engine reads."""
        receive_tensors(self._group(), specs, bucket_bytes)

    def update(self, specs: list[TensorSpec], bucket_bytes: int, build_copies: bool) -> Received:
        """Receive an update (checked by the engine) into spare memory, with the transposed copies of its
        weights if `build_copies` (the engine is decoding: see `ThreadReceiver._receive` in update_receivers.py)."""
        group = self._group()
        names = [s.name for s in specs]
        plan = self.spare.staging(specs, bucket_bytes)
        copies = UpdateCopies(self.book, self.spare.incoming(names), eager=build_copies)
        last_byte = time.perf_counter()

        def after_bucket(indices: list[int]) -> None:
            nonlocal last_byte
            last_byte = time.perf_counter()
            plan.after_bucket(indices)
            copies.received(indices)

        receive_tensors(group, specs, bucket_bytes, plan.targets, on_bucket=after_bucket)
        ref = self.names.ref
        spares = {i: ref(t) for i, t in self.spare.spares_of(names)}
        refs = {slot: ref(c) for slot, c in copies.copies.items()}
        key = (tuple(spares.items()), tuple(refs.items()))
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = len(self.layouts)
        else:
            spares = refs = None  # the engine has them
        received = Received(last_byte, spares, list(copies.slots), refs, list(copies.stale), copies.seconds, layout,
                            self.names.take_new())
        # The engine switches to these before it sends the next update: mirror it now
        self.spare.switch(names, copy_members=False)
        self.book.use(copies.copies)
        return received

    def bare_receive(self, sizes: list[int]) -> float:
        """A baseline for benchmarks: after a barrier, receive one broadcast of each size (bytes) into buffers
        kept for it, and nothing else; returns the seconds that took."""
        group = self._group()
        if [b.numel() for b in self._bare] != sizes:
            self._bare = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        group.barrier()
        start = time.perf_counter()
        receive_tensors(group, [TensorSpec(str(i), torch.uint8, (n,)) for i, n in enumerate(sizes)], 0, self._bare)
        return time.perf_counter() - start

    def _group(self) -> WeightUpdateGroup:
        if self.group is None:
            raise WeightSyncError("the receiving process is in no weight-update group")
        return self.group


def _main(conn, setup: Setup) -> None:
    """The receiving process: answer each command (method name, arguments) with ("ok", result) or
    ("sync_error" | "error", message) until told to stop."""
    if setup.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, setup.cpus)
    torch.set_num_threads(1)
    state = _Process(setup)
    del setup
    try:
        while True:
            command, args = conn.recv()
            if command == "stop":
                return
            try:
                conn.send(("ok", getattr(state, command)(*args)))
            except WeightSyncError as e:
                conn.send(("sync_error", str(e)))
            except Exception as e:  # report, keep serving: the engine decides what to do
                log.exception("weight receiver: %s failed", command)
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except (EOFError, KeyboardInterrupt):  # the engine went away
        return
    finally:
        state.leave()


class ReceivingProcess:
    """The engine's handle on its receiving process: start it, call its commands (one at a time), stop it.
    Storages it refers to are kept here by number; `tensor(ref)` is the engine's view of one."""

    def __init__(self, setup: Setup):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, setup), name="weight-receiver", daemon=True)
        self.process.start()
        child.close()
        self._calling = False
        self._storages: dict[int, torch.Tensor] = {}
        self._views: dict[Ref, torch.Tensor] = {}
        self._layouts: dict[int, tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]] = {}

    async def call(self, command: str, *args):
        """Run `command` there and return its result. The answer is awaited on the event loop, not on a thread of
        its own: every thread that wakes up in the engine's process takes the GIL from decoding once more.
        Raises WeightSyncError for a failed transfer, ReceiverDied when the process exited, RuntimeError for
        anything else it reports. One call at a time (the engine's update lock)."""
        assert not self._calling, "one call at a time"
        self._calling = True
        try:
            self._conn.send((command, args))
            await self._readable()
            status, result = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join(timeout=5)
            self._calling = False
            raise ReceiverDied(self._died()) from None
        except BaseException:
            # cancelled (a deadline, the server shutting down) with the command still running there: the process
            # stays marked busy, so that `close` kills it rather than wait for an answer that may never come
            raise
        self._calling = False
        if status == "sync_error":
            raise WeightSyncError(result)
        if status == "error":
            raise RuntimeError(f"weight receiver: {result}")
        if isinstance(result, Received):
            self._storages.update(result.new)
            result.new = {}
        return result

    @property
    def busy(self) -> bool:
        """A command was sent and its answer not read (the call was cancelled): the process may be in it still."""
        return self._calling

    def tensors(self, received: Received) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The engine's views of where an update was received: (storage number -> its spare, slot -> copy)."""
        if received.spares is not None:
            self._layouts[received.layout] = ({i: self.tensor(ref) for i, ref in received.spares.items()},
                                              {slot: self.tensor(ref) for slot, ref in received.copies.items()})
        return self._layouts[received.layout]

    def tensor(self, ref: Ref) -> torch.Tensor:
        view = self._views.get(ref)
        if view is None:
            view = self._views[ref] = torch.empty(0, dtype=ref.dtype).set_(
                self._storages[ref.key].untyped_storage(), ref.offset, ref.shape, ref.stride)
        return view

    async def _readable(self) -> None:
        """Until the answer is there, or the process has exited (its sentinel becomes readable)."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fds = (self._conn.fileno(), self.process.sentinel)
        for fd in fds:
            loop.add_reader(fd, _resolve, ready)
        try:
            await ready
        finally:
            for fd in fds:
                loop.remove_reader(fd)
        if not self._conn.poll():
            self.process.join(timeout=5)
            raise ReceiverDied(self._died())

    def _died(self) -> str:
        return f"the weight-receiving process exited (exit code {self.process.exitcode})"

    def close(self) -> None:
        """Stop the process: asked to, or killed when it is busy in a transfer (which may wait long on a peer)."""
        if not self._calling:
            try:
                self._conn.send(("stop", ()))
            except (OSError, ValueError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._conn.close()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
