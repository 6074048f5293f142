"""The engine's side of a weight update: switching to the received weights at a step boundary.

A receiver (update_receivers.py) receives an update into the spare side of the weights while decoding goes on and
hands the engine a `PendingSwitch`. `WeightSwitch.switch` runs it on the engine thread between two steps (or on
the receiving thread when the engine thread is parked with nothing to run): spare and live storage swap places
(no copy: see spare_weights.py), so running sequences continue from their KV cache under the new weights, and the
runner's copies of the weights (transposed or packed: slot_runner.py) follow. Copies built before the switch are
taken into use with it; those of an update that arrived while nothing was decoding are built after it, on a
thread of their own, the live weights multiplied by meanwhile (`take_copies_after`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pipelinerl.engines.embedded.cpus import CpuSplit
from pipelinerl.engines.embedded.metrics import Metrics
from pipelinerl.engines.embedded.model_runner import HFRunner
from pipelinerl.engines.embedded.slot_runner import SlotRunner
from pipelinerl.engines.embedded.spare_weights import SpareWeights
from pipelinerl.engines.embedded.update_receivers import PendingSwitch


class WeightSwitch:
    """The engine's weights, their version and their spare side, and the switches between them. `cv` is the
    engine's condition: the pending switch is read and cleared under it, and it is notified when copies built
    after a switch are ready."""

    def __init__(self, runner: SlotRunner | HFRunner, params: dict[str, torch.Tensor], metrics: Metrics,
                 cv: threading.Condition, version: int, cpus: CpuSplit):
        self.runner = runner
        self.metrics = metrics
        self._cv = cv
        self.version = version
        self.spare = SpareWeights(params, getattr(runner, "fused_groups", []))
        self.pending: PendingSwitch | None = None  # set by the engine's hand-over, under `cv`
        # Where the runner multiplies by transposed copies of weights (CPU), the copies of an update that arrived
        # while nothing was decoding are built on this thread after the switch (see ThreadReceiver._receive)
        self._copier = None
        if getattr(runner, "relayout_slots", None):
            self._copier = ThreadPoolExecutor(1, "engine-relayout", initializer=cpus.pin_transfer)
        # copies being built after a switch (when idle: see ThreadReceiver._receive): (version, slots, their future)
        self._copies_after: tuple[int, list[int], Future] | None = None

    @property
    def transposed_copies(self) -> bool:
        """The runner multiplies by copies of weights (transposed or packed), which every update renews."""
        return self._copier is not None

    def has_work(self) -> bool:
        """A switch to run, or copies built after one to take into use; read under `cv`."""
        return self.pending is not None or self._copies_after is not None and self._copies_after[2].done()

    def count_copies(self, pending: PendingSwitch) -> None:
        """Count the copies of an update's weights built before its switch (the receiver built them)."""
        if pending.changes_copies:
            self.metrics.relayouts += not pending.copies_after  # all built before the switch
            self.metrics.relayout_seconds += pending.copy_seconds

    def switch(self, decoding: bool) -> None:
        """Switch to the pending update, if any, and tell its receiver. Between steps only: on the engine thread,
        or under `cv` while the engine thread is parked. `decoding`: sequences are running (counted)."""
        pending = self.pending
        if pending is None:
            return
        t0 = time.perf_counter()
        if self._copies_after is not None:  # copies still being built after an earlier switch
            _, slots, future = self._copies_after
            self._copies_after = None
            if not set(slots) <= {*pending.copies, *pending.stale_copies, *pending.copies_after}:
                self.runner.use_copies(future.result())  # some stay current after this switch: wait for them
        self.spare.switch(pending.names)
        self.version = pending.version
        if pending.copies:
            self.runner.use_copies(pending.copies, foreign=pending.foreign_copies)
        if pending.stale_copies:  # only a partial update of a fused weight: rebuilt here, in the decode pause
            self.runner.use_copies(self.runner.build_copies(self._live(pending.stale_copies)))
        if pending.copies_after:  # the live weights until their copies are built (and still current)
            self.runner.use_copies(self._live(pending.copies_after))
            future = self._copier.submit(self._build_copies_after, self._live(pending.copies_after))
            self._copies_after = (self.version, pending.copies_after, future)
            future.add_done_callback(self._notify_engine)  # to take them into use even while idle
        pending.switch_s = time.perf_counter() - t0
        self.metrics.update_switch_seconds += pending.switch_s
        if decoding:
            self.metrics.updates_while_running += 1
        with self._cv:
            self.pending = None
        pending.done.set()
        if pending.on_done is not None:
            pending.on_done()

    def take_copies_after(self) -> None:
        """Copies built after a switch, taken into use once ready, unless a newer switch came first. Between
        steps, on the engine thread."""
        if self._copies_after is None or not self._copies_after[2].done():
            return
        (version, _, future), self._copies_after = self._copies_after, None
        if version == self.version and future.exception() is None:
            self.runner.use_copies(future.result())
            self.metrics.relayouts += 1

    def close(self) -> None:
        """Stop building copies (the engine is shutting down)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)

    def _live(self, slots: list[int]) -> dict[int, torch.Tensor]:
        return {slot: self.runner.relayout_slots[slot][2] for slot in slots}

    def _build_copies_after(self, live: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        copies = self.runner.build_copies(live)
        self.metrics.relayout_seconds += time.perf_counter() - t0
        return copies

    def _notify_engine(self, _: object = None) -> None:
        with self._cv:
            self._cv.notify()
