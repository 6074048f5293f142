"""How a transfer runs (free to change, the bytes on the wire stay the same): up to `PIPELINE_DEPTH` broadcasts
are in flight, so packing or unpacking one bucket overlaps the transfer of another; a bucket whose tensors
already lie in memory as the wire lays them out is sent or received in place, and the others go through
flat buffers that the group keeps and reuses across buckets and updates (`BucketBuffers`). The trainer keeps
its parameters laid out that way (`adopt_wire_layout`) and the embedded engine receives into buffers laid
out that way, so neither copies a byte of a bucketed update.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipelinerl.weight_sync.errors import WeightSyncError, _as_sync_error
from pipelinerl.weight_sync.wire import (
    TensorSpec,
    _Bucket,
    _layout,
    _on_wire,
    _pack,
    _unpack,
    _wire_view,
    wire_buffers,
)

if TYPE_CHECKING:  # a hint only: `group` imports this module (the group keeps its BucketBuffers and _SendPlan)
    from pipelinerl.weight_sync.group import WeightUpdateGroup

# Broadcasts in flight at once: (un)packing one bucket overlaps the transfer of the one before it.
PIPELINE_DEPTH = 2


class BucketBuffers:
    """Flat uint8 buffers for packing (sender) or unpacking (receiver) buckets, one per pipeline slot, kept
    for the life of the group.

    A fresh buffer per bucket costs more than the copy into it: a bucket above glibc's mmap threshold (at
    most 32 MB) gets new pages from the kernel on every allocation, each faulted in on first write. Reused
    buffers sized once to the largest bucket make steady-state updates allocate nothing, at a fixed cost of
    `PIPELINE_DEPTH` buckets of memory per process.
    """

    def __init__(self) -> None:
        self._slots: list[torch.Tensor | None] = [None] * PIPELINE_DEPTH

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Make every slot hold at least `nbytes` on `device` (before a transfer, so none grows midway)."""
        if nbytes <= 0:
            return
        for i, buf in enumerate(self._slots):
            if buf is None or buf.numel() < nbytes or buf.device != device:
                self._slots[i] = None  # free the old buffer before allocating its replacement
                self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def slot(self, k: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer for bucket `k` (see `_pipelined` for when it is free)."""
        buf = self._slots[k % PIPELINE_DEPTH]
        assert buf is not None and buf.numel() >= nbytes, "reserve() first"
        return buf[:nbytes]

    def clear(self) -> None:
        self._slots = [None] * PIPELINE_DEPTH


def _check_timeout(e: Exception, group: WeightUpdateGroup) -> WeightSyncError:
    return _as_sync_error(e, f"broadcast in group {group.group_name!r} failed", group.timeout_s,
                          "a member died, stalled or refused the update; the engines' logs say which")


def _wire_views(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], buckets: Sequence[_Bucket],
                group: WeightUpdateGroup) -> list[torch.Tensor | None]:
    """`_wire_view` of every bucket; reserves the group's buffers for the buckets that have none."""
    views = [_wire_view(tensors, specs, b, group.device) for b in buckets]
    group.buffers.reserve(max((b.nbytes for b, v in zip(buckets, views) if v is None), default=0), group.device)
    return views


def _pipelined(group: WeightUpdateGroup, buckets: Sequence[_Bucket],
               prepare: Callable[[int, _Bucket], torch.Tensor],
               finish: Callable[[int, _Bucket, torch.Tensor], None] | None = None) -> None:
    """One broadcast per bucket, with up to `PIPELINE_DEPTH` in flight: while the process group's worker
    thread moves bucket k, this thread packs bucket k+1 (`prepare`, sender) or unpacks bucket k-1 (`finish`,
    receiver). Bucket k may reuse the buffer slot `k % PIPELINE_DEPTH`: bucket k - PIPELINE_DEPTH, its last
    user, is finished before bucket k is prepared."""
    in_flight: deque[tuple[dist.Work, int, _Bucket, torch.Tensor]] = deque()
    # NCCL's plain wait() only orders the current CUDA stream after the broadcast and returns: a dead or stalled
    # peer would then surface as the watchdog's abort, with no Python error naming the group. With a limit the
    # thread blocks until the broadcast completes and raises when it does not in time. Gloo's wait() blocks and
    # honours the group's own timeout.
    wait_limit = timedelta(seconds=group.timeout_s) if group.backend == "nccl" else None

    def complete_oldest() -> None:
        work, k, bucket, tensor = in_flight.popleft()
        if wait_limit is None:
            work.wait()
        else:
            work.wait(wait_limit)
        if finish is not None:
            finish(k, bucket, tensor)

    try:
        for k, bucket in enumerate(buckets):
            if len(in_flight) >= PIPELINE_DEPTH:
                complete_oldest()
            tensor = prepare(k, bucket)
            # The tensor stays referenced in `in_flight` until its broadcast is done.
            in_flight.append((group.broadcast_async(tensor), k, bucket, tensor))
        while in_flight:
            complete_oldest()
    except RuntimeError as e:
        group.buffers.clear()  # a broadcast still in flight may write into them; the next update gets new ones
        raise _check_timeout(e, group) from e


@dataclass(frozen=True)
class _SendPlan:
    """What `broadcast_tensors` works out before sending (specs, buckets, which buckets go from the tensors'
    own memory), kept by the group for the next call with the same tensors at the same addresses: every
    update of a run sends the same parameters, and working it out again is latency before the first byte.
    It keeps no tensor: views of what was sent would keep a copy made for one update alive into the next."""

    key: tuple
    specs: list[TensorSpec]
    buckets: list[_Bucket]
    in_place: list[bool]  # per bucket: sent from the tensors' own memory
    buffer_bytes: int  # the largest bucket that is packed


def _send_views(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor], bucket_bytes: int
                ) -> tuple[_SendPlan, list[torch.Tensor | None]]:
    """The send plan for `tensors` (cached in the group) and, per bucket, its view of the tensors' own memory
    or None (packed). Reserves the group's buffers for the packed ones."""
    key = (bucket_bytes, tuple((t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for t in tensors))
    detached = [t.detach() for t in tensors]
    plan = group.send_plan
    views: list[torch.Tensor | None] | None = None
    if plan is not None and plan.key == key:
        views = [_wire_view(detached, plan.specs, b, group.device) if ok else None
                 for b, ok in zip(plan.buckets, plan.in_place)]
        if any(ok and v is None for ok, v in zip(plan.in_place, views)):  # same addresses, other memory
            views = None
    if views is None:
        specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
        buckets = _layout(specs, bucket_bytes)
        views = [_wire_view(detached, specs, b, group.device) for b in buckets]
        packed = max((b.nbytes for b, v in zip(buckets, views) if v is None), default=0)
        plan = group.send_plan = _SendPlan(key, specs, buckets, [v is not None for v in views], packed)
    group.buffers.reserve(plan.buffer_bytes, group.device)
    return plan, views


def broadcast_tensors(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor], bucket_bytes: int = 0,
                      ready: Callable[[], None] | None = None) -> int:
    """Rank 0: send `tensors` to every other member. Returns the bytes sent.

    A bucket whose tensors already lie in memory as the wire format lays them out (any contiguous tensor on
    the group's device per tensor, or of a multiple of `ALIGN` bytes alone in a bucket) is sent from their
    own memory; the others are packed into the group's reused buffers. The tensors must not change until
    this returns. `ready()`, when given, is called once all is set, just before the first broadcast (the
    trainer posts the engines' update requests there, so they are handled while this process waits)."""
    plan, views = _send_views(group, tensors, bucket_bytes)
    sources: list[torch.Tensor] = []

    def prepare(k: int, bucket: _Bucket) -> torch.Tensor:
        flat = views[k]
        if flat is None:
            if not sources:
                sources.extend(t.detach() for t in tensors)
            flat = _pack(sources, plan.specs, bucket, group.buffers.slot(k, bucket.nbytes))
        return _on_wire(flat, plan.specs, bucket, bucket_bytes)

    if ready is not None:
        ready()
    _pipelined(group, plan.buckets, prepare)
    return sum(b.nbytes for b in plan.buckets)


def broadcast_stream(group: WeightUpdateGroup, specs: Sequence[TensorSpec], tensors: Iterable[torch.Tensor],
                     bucket_bytes: int = 0, ready: Callable[[], None] | None = None) -> int:
    """Rank 0: send tensors that are produced one at a time, in the order of `specs`, as `broadcast_tensors`
    would send a list of them. Returns the bytes sent.

    Each tensor is copied into the group's reused buffers (converted to its spec's dtype) as soon as it is
    taken, and the next one is asked for only after that: a producer that gathers sharded parameters may free
    each one once the next is asked for. So the whole update never exists at once on this rank; the memory it
    takes is `PIPELINE_DEPTH` buffers of the largest bucket (with `bucket_bytes` = 0: of the largest tensor)."""
    buckets = _layout(specs, bucket_bytes)
    group.buffers.reserve(max((b.nbytes for b in buckets), default=0), group.device)
    source = iter(tensors)

    def prepare(k: int, bucket: _Bucket) -> torch.Tensor:
        flat = group.buffers.slot(k, bucket.nbytes)
        for i, offset in zip(bucket.indices, bucket.offsets):
            spec, t = specs[i], next(source, None)
            if t is None or tuple(t.shape) != spec.shape:
                raise ValueError(f"tensor {i} ({spec.name}) of the stream is "
                                 f"{'missing' if t is None else list(t.shape)}, its spec says {list(spec.shape)}")
            flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(t)
        return _on_wire(flat, specs, bucket, bucket_bytes)

    if ready is not None:
        ready()
    _pipelined(group, buckets, prepare)
    if next(source, None) is not None:  # also lets a gathering producer leave its last unit
        raise ValueError(f"the stream has more tensors than the {len(specs)} specs")
    return sum(b.nbytes for b in buckets)


def receive_tensors(group: WeightUpdateGroup, specs: Sequence[TensorSpec], bucket_bytes: int = 0,
                    out: Sequence[torch.Tensor] | None = None,
                    on_bucket: Callable[[list[int]], None] | None = None) -> list[torch.Tensor]:
    """Rank > 0: receive the tensors described by `specs` from rank 0, into `out` when given.

    A bucket is received straight into `out` when its tensors lie there as the wire format lays them out
    (`wire_buffers`; per tensor, any contiguous tensor of the spec's dtype on the group's device); other
    buckets go through the group's reused buffers and are copied out. Without `out`, the result is
    `wire_buffers` (no copies). `on_bucket(indices)` is called as soon as the tensors `indices` (of `specs`)
    are in place, while later buckets are still arriving, so work on them overlaps the transfer."""
    if out is not None and len(out) != len(specs):
        raise ValueError(f"{len(out)} output tensors for {len(specs)} specs")
    result = list(out) if out is not None else wire_buffers(specs, bucket_bytes, group.device)
    buckets = _layout(specs, bucket_bytes)
    views = _wire_views(result, specs, buckets, group)

    def prepare(k: int, bucket: _Bucket) -> torch.Tensor:
        flat = views[k]
        if flat is not None and bucket_bytes <= 0:
            return result[bucket.indices[0]]  # the tensor itself, as _on_wire would view it, with no view op
        return _on_wire(flat if flat is not None else group.buffers.slot(k, bucket.nbytes), specs, bucket,
                        bucket_bytes)

    def finish(k: int, bucket: _Bucket, received: torch.Tensor) -> None:
        if views[k] is None:
            _unpack(received, specs, bucket, result)
        if on_bucket is not None:
            on_bucket(bucket.indices)

    _pipelined(group, buckets, prepare, finish)
    return result


def receive_stream(group: WeightUpdateGroup, specs: Sequence[TensorSpec], bucket_bytes: int = 0
                   ) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank > 0: the tensors of an update as they arrive, (index in `specs`, tensor), bucket by bucket, in memory
    that is used again for later buckets: the consumer must be done with (or have copied) a bucket's tensors when
    it asks for the first tensor of the next bucket but one. Only `PIPELINE_DEPTH` buckets of memory are taken,
    whatever the update's size (the whole update never exists on this rank). `drain` throws everything away."""
    buckets = _layout(specs, bucket_bytes)
    group.buffers.reserve(max((b.nbytes for b in buckets), default=0), group.device)
    wait_limit = timedelta(seconds=group.timeout_s) if group.backend == "nccl" else None
    in_flight: deque[tuple[dist.Work, _Bucket, torch.Tensor]] = deque()

    def issue(k: int) -> None:
        bucket = buckets[k]
        tensor = _on_wire(group.buffers.slot(k, bucket.nbytes), specs, bucket, bucket_bytes)
        in_flight.append((group.broadcast_async(tensor), bucket, tensor))

    try:
        for k in range(min(PIPELINE_DEPTH, len(buckets))):
            issue(k)
        for k in range(len(buckets)):
            work, bucket, received = in_flight.popleft()
            work.wait() if wait_limit is None else work.wait(wait_limit)
            flat = received.reshape(-1).view(torch.uint8)
            for i, offset in zip(bucket.indices, bucket.offsets):
                spec = specs[i]
                yield i, flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
            # the consumer asked past this bucket: its slot is free for the bucket PIPELINE_DEPTH later
            if k + PIPELINE_DEPTH < len(buckets):
                issue(k + PIPELINE_DEPTH)
    except RuntimeError as e:
        group.buffers.clear()  # a broadcast still in flight may write into them; the next update gets new ones
        raise _check_timeout(e, group) from e


def drain(group: WeightUpdateGroup, specs: Sequence[TensorSpec], bucket_bytes: int = 0) -> None:
    """Rank > 0: take part in an update's broadcasts and keep nothing (a refused update: the sender and the other
    members are not left waiting), in `PIPELINE_DEPTH` buckets of memory on the group's device."""
    for _ in receive_stream(group, specs, bucket_bytes):
        pass
