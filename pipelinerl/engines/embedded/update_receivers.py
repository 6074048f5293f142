"""Where the embedded engine receives weight updates: one interface (`UpdateReceiver`), two implementations.

An update is received into the spare side of the weights (`spare_weights.py`) while decoding goes on, with the
transposed copies of the new weights where the runner multiplies by such copies (`transpose.py`). The receiver
fills a `PendingSwitch` with what the engine thread must do, hands it over (`EngineSide.hand_over`), and returns
once the engine thread has switched at its next step boundary (weight_switch.py's `WeightSwitch.switch`).

- `ThreadReceiver`: on a worker thread of the engine's process. The default on GPU, where decoding runs on the
  device and the receiving thread's Python costs it little.
- `ProcessReceiver`: in a process of its own (`receiving_process.py`), the weights in shared memory. The default on CPU,
  where a receiving thread's Python takes the GIL that decoding needs between its torch calls.

Both are called from the server's event loop, one call at a time (the engine's update lock), and neither adds
a thread wake-up to an update's path after its last byte: every wake-up is latency the trainer waits through.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipelinerl.contracts.inference import InitWeightUpdateGroupRequest
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.embedded.cpus import CpuSplit
from pipelinerl.engines.embedded.receiving_process import ReceiverDied, ReceivingProcess, Setup, shared_memory_shortfall
from pipelinerl.engines.embedded.spare_weights import SpareWeights
from pipelinerl.engines.embedded.transpose import UpdateCopies
from pipelinerl.weight_sync import (
    JOIN_GRACE_S,
    TensorSpec,
    WeightSyncError,
    WeightSyncTimeout,
    WeightUpdateGroup,
    join_weight_update_group,
    receive_tensors,
)

log = logging.getLogger(__name__)

# EngineSettings.update_receiver: "process" (ProcessReceiver; CPU only), "thread" (ThreadReceiver), "auto" (a
# process on CPU where there is shared memory enough, a thread otherwise)
UPDATE_RECEIVERS = ("auto", "process", "thread")


@dataclass
class PendingSwitch:
    """A received update, for the engine thread to switch to: filled by the receiver, switched by the engine."""

    version: int
    names: list[str]  # the parameters received into the spare storage
    done: threading.Event = field(default_factory=threading.Event)
    switch_s: float = 0.0
    # Transposed copies of the received weights by the runner's relayout slot, built before the switch; the
    # slots whose weights the switch changes in place (a partial update), whose copies it rebuilds; the slots
    # whose copies are built after the switch (the engine was idle: see ThreadReceiver._receive).
    copies: dict[int, torch.Tensor] = field(default_factory=dict)
    stale_copies: list[int] = field(default_factory=list)
    copies_after: list[int] = field(default_factory=list)
    foreign_copies: bool = False  # `copies` are the receiving process's (see SlotRunner.use_copies)
    copy_seconds: float = 0.0  # spent building `copies`
    on_done: Callable[[], None] | None = None  # called by the thread that switched

    @property
    def changes_copies(self) -> bool:
        """Whether the update changes weights the runner keeps transposed copies of."""
        return bool(self.copies or self.stale_copies or self.copies_after)


@dataclass(frozen=True)
class EngineSide:
    """What a receiver uses of the engine it receives for (EmbeddedEngine builds it)."""

    params: dict[str, torch.Tensor]  # name -> parameter, tied names included
    runner: Any  # the SlotRunner: its fused buffers and relayout slots
    spare: SpareWeights
    cpus: CpuSplit
    transposed_copies: bool  # the runner multiplies by transposed copies of weights, which an update renews
    busy: Callable[[], bool]  # requests running or queued: then copies are built before the switch
    hand_over: Callable[[PendingSwitch], None]  # switch at the engine thread's next step boundary, now if idle
    check_engine_thread: Callable[[], None]  # raises the contract's 500 once the engine thread died


class UpdateReceiver(ABC):
    """Joins the weight-update group, receives each update beside decoding and has the engine switch to it.
    Transfer failures raise WeightSyncError (the engine answers 504); anything else is the contract's error."""

    def __init__(self, engine: EngineSide):
        self.engine = engine
        self.group_name: str | None = None  # the weight-update group it is in
        self.restarts = 0  # receiving processes that died and were replaced (ProcessReceiver)

    @abstractmethod
    async def join(self, req: InitWeightUpdateGroupRequest) -> None:
        """Leave the group it is in, if any, and join the one `req` names."""

    @abstractmethod
    async def drain(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        """Take part in an update the engine refused, so that no peer is left hanging; write nothing."""

    @abstractmethod
    async def receive_and_switch(self, specs: list[TensorSpec], bucket_bytes: int, pending: PendingSwitch) -> float:
        """Receive a checked update into the spare weights, fill `pending`, hand it to the engine thread and
        return once it switched: when the last byte arrived (`time.perf_counter`)."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group and let go of what receiving holds (the engine is shutting down)."""


def make_receiver(choice: str, engine: EngineSide) -> UpdateReceiver:
    """The receiver EngineSettings.update_receiver (`choice`) asks for; ValueError naming it if it cannot work."""
    if choice not in UPDATE_RECEIVERS:
        raise ValueError(f"update_receiver must be one of {', '.join(UPDATE_RECEIVERS)}, not {choice!r}")
    weights = list({id(p): p for p in engine.params.values()}.values())  # tied parameters once
    device = weights[0].device
    if choice == "thread" or (choice == "auto" and device.type != "cpu"):
        return ThreadReceiver(engine)
    if device.type != "cpu":
        raise ValueError(f"update_receiver 'process' needs the model on CPU, it is on {device}; use 'thread'")
    # a weight may have two copies (packed, and transposed for one row): what the runner keeps decides
    copies = [live for _, _, live in getattr(engine.runner, "relayout_slots", [])]
    shortfall = shared_memory_shortfall(sum(p.numel() * p.element_size() for p in weights),
                                        sum(w.numel() * w.element_size() for w in copies))
    if shortfall and choice == "process":
        raise ValueError(f"update_receiver 'process': {shortfall}; or use 'thread'")
    if shortfall:
        log.warning("%s; receiving updates on a thread of the server instead", shortfall)
        return ThreadReceiver(engine)
    return ProcessReceiver(engine)


def _group_arguments(req: InitWeightUpdateGroupRequest) -> tuple:
    """`init_weight_update_group`'s arguments, in its order."""
    return (req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend, req.group_name,
            req.timeout_s)


class ThreadReceiver(UpdateReceiver):
    """Receives on a worker thread of the engine's process, which also waits there for the switch."""

    def __init__(self, engine: EngineSide):
        super().__init__(engine)
        self.group: WeightUpdateGroup | None = None

    async def join(self, req: InitWeightUpdateGroupRequest) -> None:
        self.leave()
        # bounded (join_weight_update_group): an abandoned rendezvous never holds a thread of the server's pool
        self.group = await asyncio.to_thread(join_weight_update_group, *_group_arguments(req))
        self.group_name = req.group_name

    async def drain(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        await asyncio.to_thread(receive_tensors, self.group, specs, bucket_bytes)

    async def receive_and_switch(self, specs: list[TensorSpec], bucket_bytes: int, pending: PendingSwitch) -> float:
        return await asyncio.to_thread(self._receive_and_switch, specs, bucket_bytes, pending)

    def close(self) -> None:
        self.leave()

    def leave(self) -> None:
        self.group_name = None
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def _receive_and_switch(self, specs: list[TensorSpec], bucket_bytes: int, pending: PendingSwitch) -> float:
        """On the worker thread: receive, hand over, and wait for the switch here (not in another thread hop)."""
        received = self._receive(specs, bucket_bytes, pending)
        self.engine.hand_over(pending)
        while not pending.done.wait(1.0):
            self.engine.check_engine_thread()
        return received

    def _receive(self, specs: list[TensorSpec], bucket_bytes: int, pending: PendingSwitch) -> float:
        engine = self.engine
        engine.cpus.pin_transfer()  # a pool thread: pinned again each time, it costs one system call
        group = self.group
        plan = engine.spare.staging(specs, bucket_bytes)
        copies = None
        if engine.transposed_copies:
            # Copies before the switch only where it matters: with sequences decoding. With none, the switch
            # should not wait (the trainer waits for it), nor the transfer share the CPUs with copying.
            copies = UpdateCopies(engine.runner, engine.spare.incoming(pending.names), eager=engine.busy())

        received = time.perf_counter()

        def after_bucket(indices: list[int]) -> None:
            nonlocal received
            received = time.perf_counter()  # the last bucket's: when the last byte arrived
            plan.after_bucket(indices)
            if copies is not None:
                copies.received(indices)

        receive_tensors(group, specs, bucket_bytes, plan.targets, on_bucket=after_bucket)
        if copies is not None and copies.slots:
            pending.copies = copies.copies
            pending.stale_copies = copies.stale
            pending.copies_after = [slot for slot in copies.slots if slot not in pending.copies
                                    and slot not in copies.stale]
            pending.copy_seconds = copies.seconds
        return received


class ProcessReceiver(UpdateReceiver):
    """Receives in a process of its own (receiving_process.py), started when first asked to join a group; the engine's
    weights move to shared memory at construction, before decoding starts (moving memory that a step reads
    would pull it from under the step). Everything is awaited on the event loop: no thread of the engine's
    process wakes up for an update but the event loop's and the engine thread, which says when it switched."""

    def __init__(self, engine: EngineSide):
        super().__init__(engine)
        self._process: ReceivingProcess | None = None
        for t in [*engine.params.values(), *(buffer for buffer, _ in getattr(engine.runner, "fused_groups", []))]:
            t.share_memory_()

    async def join(self, req: InitWeightUpdateGroupRequest) -> None:
        """In the receiving process, which leaves its group first, bounded there (join_weight_update_group); and
        bounded here too: a process that does not answer within the deadline is killed (it starts afresh at the
        next call), so that nothing waits on its rendezvous, not even this engine's shutdown."""
        self.group_name = None
        try:
            await asyncio.wait_for(self.call("join", *_group_arguments(req)), req.timeout_s + 2 * JOIN_GRACE_S)
        except asyncio.TimeoutError:
            process, self._process = self._process, None
            await asyncio.to_thread(process.close)
            raise WeightSyncTimeout(f"joining weight-update group {req.group_name!r} at {req.master_address}:"
                                    f"{req.master_port} did not finish within timeout_s={req.timeout_s:g}; the "
                                    "receiving process was replaced") from None
        self.group_name = req.group_name

    async def drain(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        await self.call("drain", specs, bucket_bytes)

    async def receive_and_switch(self, specs: list[TensorSpec], bucket_bytes: int, pending: PendingSwitch) -> float:
        engine = self.engine
        # the process builds the copies as the weights arrive, if the engine is decoding (see ThreadReceiver)
        received = await self.call("update", specs, bucket_bytes, engine.transposed_copies and engine.busy())
        loop = asyncio.get_running_loop()
        switched = loop.create_future()
        try:
            spares, copies = self._process.tensors(received)
            engine.spare.take_spares(pending.names, spares)
            if received.slots:
                pending.copies = copies
                pending.foreign_copies = True
                pending.stale_copies = received.stale
                pending.copies_after = [slot for slot in received.slots
                                        if slot not in copies and slot not in received.stale]
                pending.copy_seconds = received.copy_seconds
            pending.on_done = functools.partial(loop.call_soon_threadsafe, _resolve, switched)
            engine.hand_over(pending)
        except BaseException:
            # The receiving process counts this update as switched to and would receive the next one into what
            # is still live here: replace it (it starts from the live weights) and let the trainer rejoin.
            process, self._process, self.group_name = self._process, None, None
            await asyncio.to_thread(process.close)
            raise
        while not switched.done():
            await asyncio.wait([switched], timeout=1.0)
            engine.check_engine_thread()
        return received.last_byte

    async def call(self, command: str, *args):
        """Run a command in the receiving process (receiving_process.py's `_Process`), starting it first if need be. One
        that died is replaced (and counted); the group it was in is gone with it."""
        if self._process is not None and self._process.busy:  # a call that was cancelled midway: start afresh
            process, self._process = self._process, None
            await asyncio.to_thread(process.close)
        if self._process is None:
            self._process = await asyncio.to_thread(ReceivingProcess, self._setup())
        try:
            return await self._process.call(command, *args)
        except ReceiverDied as e:
            log.error("%s; starting another", e)
            self._process = await asyncio.to_thread(ReceivingProcess, self._setup())
            self.restarts += 1
            self.group_name = None
            raise ContractError(500, f"{e}; another was started: join a weight-update group again with "
                                     "/v1/weights/init_group", type="engine_error") from None
        except WeightSyncError:
            raise
        except RuntimeError as e:  # reported by the process, which goes on serving
            raise ContractError(500, str(e), type="engine_error") from None

    def close(self) -> None:
        if self._process is not None:
            self._process.close()

    def _setup(self) -> Setup:
        engine, runner = self.engine, self.engine.runner
        return Setup(engine.params, getattr(runner, "fused_groups", []),
                     [live for _, _, live in getattr(runner, "relayout_slots", [])],
                     sorted(engine.cpus.transfer) if engine.cpus.enabled else None,
                     list(getattr(runner, "relayout_layouts", [])))


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
