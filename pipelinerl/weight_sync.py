"""The weight-update process group: a torch.distributed group between a trainer (rank 0) and inference
processes that were started independently, formed by a TCP rendezvous.

The group is built directly from a `TCPStore` and a backend process group object instead of
`init_process_group`, so a process can belong to it and to its own default group (its tensor-parallel or
data-parallel world) at the same time.

Wire format of one update (the inference contract refers to this): the sender broadcasts the tensors in the
order of the spec list, from rank 0.
- `bucket_bytes == 0`: one broadcast per tensor, in the tensor's own dtype and shape (what SGLang expects).
- `bucket_bytes > 0`: tensors are laid out back to back as raw bytes, each starting at an offset rounded up
  to `ALIGN` bytes; consecutive tensors are grouped greedily into buckets of at most `bucket_bytes` (a tensor
  larger than that is a bucket of its own); each bucket is one broadcast of a flat uint8 tensor.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALIGN = 16
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """The weight-update group could not be formed or a transfer failed."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not join (or did not take part in a transfer) within the timeout."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, t.dtype, tuple(t.shape))


@dataclass(eq=False)
class WeightUpdateGroup:
    """A live group. `device` is where received tensors land (cuda for nccl, cpu for gloo)."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    group_name: str
    device: torch.device
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device))

    def destroy(self) -> None:
        """Leave the group. Call it before the process exits: a group torn down during interpreter shutdown
        can abort the process from a C++ worker thread."""
        if self.pg is None:
            return
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]
        gc.collect()


_live_groups: weakref.WeakSet[WeightUpdateGroup] = weakref.WeakSet()


@atexit.register
def _destroy_live_groups() -> None:
    for group in list(_live_groups):
        group.destroy()


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update",
    timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the group. Every member calls this; it returns once all have joined.

    Raises `WeightSyncTimeout` when some member does not join within `timeout_s`.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                              timeout=timeout, wait_for_workers=False, use_libuv=True)
    except Exception as e:  # connection refused until the master is up is retried inside; this is final
        raise _as_sync_error(e, f"rank {rank} could not reach the rendezvous at {master_address}:{master_port}",
                             timeout_s) from e
    prefix = dist.PrefixStore(group_name, store)
    try:
        # Every rank announces itself first so a missing peer is reported by rank, not as a bare timeout.
        prefix.set(f"joined/{rank}", "1")
        _wait_for_peers(prefix, world_size, deadline, group_name)
        if backend == "gloo":
            device = torch.device("cpu")
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            host = master_address if master_address.startswith("127.") or master_address == "localhost" else None
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                             else dist.ProcessGroupGloo.create_default_device()]
            pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
        else:
            device = torch.device("cuda", torch.cuda.current_device())
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, nccl_opts)
    except WeightSyncError:
        raise
    except Exception as e:
        raise _as_sync_error(e, f"rank {rank} could not form group {group_name!r}", timeout_s) from e
    group = WeightUpdateGroup(pg, rank, world_size, backend, group_name, device, store)
    _live_groups.add(group)
    log.info("joined weight-update group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return group


def _wait_for_peers(store: dist.Store, world_size: int, deadline: float, group_name: str) -> None:
    pending = set(range(world_size))
    while pending:
        pending = {r for r in pending if not store.check([f"joined/{r}"])}
        if not pending:
            return
        if time.monotonic() > deadline:
            raise WeightSyncTimeout(
                f"weight-update group {group_name!r}: rank(s) {sorted(pending)} of {world_size} did not join in "
                "time; check that every engine was asked to join with the same master address, port and world "
                "size")
        time.sleep(0.05)


def _as_sync_error(e: Exception, what: str, timeout_s: float) -> WeightSyncError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "timeout" in text.lower() or "timed out" in text.lower():
        return WeightSyncTimeout(f"{what} within {timeout_s:g}s: {text}")
    return WeightSyncError(f"{what}: {text}")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each broadcast, per the wire format in the module docstring."""
    if bucket_bytes <= 0:
        return [[i] for i in range(len(specs))]
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        need = _aligned(spec.nbytes)
        if current and size + need > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += need
    if current:
        buckets.append(current)
    return buckets


def _check_timeout(e: Exception, group: WeightUpdateGroup) -> WeightSyncError:
    return _as_sync_error(e, f"broadcast in group {group.group_name!r} failed", 0)


def broadcast_tensors(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor], bucket_bytes: int = 0) -> int:
    """Rank 0: send `tensors` to every other member. Returns the bytes sent."""
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
    sent = 0
    try:
        for bucket in plan_buckets(specs, bucket_bytes):
            if bucket_bytes <= 0:
                t = tensors[bucket[0]].detach().to(group.device).contiguous()
                group.broadcast(t, src=0)
                sent += t.numel() * t.element_size()
                continue
            flat = torch.empty(sum(_aligned(specs[i].nbytes) for i in bucket), dtype=torch.uint8,
                               device=group.device)
            offset = 0
            for i in bucket:
                src = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
                flat[offset:offset + src.numel()].copy_(src)
                offset += _aligned(src.numel())
            group.broadcast(flat, src=0)
            sent += flat.numel()
    except RuntimeError as e:
        raise _check_timeout(e, group) from e
    return sent


def receive_tensors(group: WeightUpdateGroup, specs: Sequence[TensorSpec], bucket_bytes: int = 0,
                    out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Rank > 0: receive the tensors described by `specs` from rank 0, into `out` when given."""
    if out is not None and len(out) != len(specs):
        raise ValueError(f"{len(out)} output tensors for {len(specs)} specs")
    result = list(out) if out is not None else [torch.empty(s.shape, dtype=s.dtype, device=group.device)
                                                 for s in specs]
    try:
        for bucket in plan_buckets(specs, bucket_bytes):
            if bucket_bytes <= 0:
                group.broadcast(result[bucket[0]], src=0)
                continue
            flat = torch.empty(sum(_aligned(specs[i].nbytes) for i in bucket), dtype=torch.uint8,
                               device=group.device)
            group.broadcast(flat, src=0)
            offset = 0
            for i in bucket:
                n = specs[i].nbytes
                result[i].copy_(flat[offset:offset + n].view(specs[i].dtype).view(specs[i].shape))
                offset += _aligned(n)
    except RuntimeError as e:
        raise _check_timeout(e, group) from e
    return result


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
