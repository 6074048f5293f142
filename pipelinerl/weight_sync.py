"""The weight-update process group: a torch.distributed group between a trainer (rank 0) and inference
processes that were started independently, formed by a TCP rendezvous.

Every member forms it the way SGLang does (`init_custom_process_group` in sglang/srt/utils, which vLLM's RLHF
examples share), so an engine that joins with its own code (SGLang) meets the trainer: rank 0 hosts a
`TCPStore` (on a port the kernel picks: `host_rendezvous`), every other member reaches it through torch's
`tcp://address:port` rendezvous, and each one wraps the store in `PrefixStore(group_name, store)` and makes the
group with torch's `_new_process_group_helper(world_size, rank, [], backend, store, group_name=...)`, which
adds prefixes of its own (group name, device). Members' ranks are the trainer's 0, then each engine's
`rank_offset` + its tensor-parallel rank. Not `init_process_group`: a process can belong to the group and to
its own default group (its tensor-parallel or data-parallel world) at the same time, or to no default group.
No handshake of our own (SGLang would not take part in it): over gloo, making the group waits for every
member, so one that never joins is a timeout naming the group, its world size, where it was hosted and what to
check; over NCCL each member returns at once and the communicator is made at the first broadcast (the trainer
still waits for every engine's answer to its join request). torch registers the group under its name in the
process; `destroy()` unregisters it, so a process can join again under the same name. A further member of the
group in the same process (tests that run an engine and its trainer together, or a join while an earlier one
was never destroyed) is registered under a name of its own, its store keys renamed to the group's.

Wire format of one update (the inference contract refers to this): the sender broadcasts the tensors in the
order of the spec list, from rank 0.
- `bucket_bytes == 0`: one broadcast per tensor, in the tensor's own dtype and shape (what SGLang expects).
- `bucket_bytes > 0`: tensors are laid out back to back as raw bytes, each starting at an offset rounded up
  to `ALIGN` bytes; consecutive tensors are grouped greedily into buckets of at most `bucket_bytes` (a tensor
  larger than that is a bucket of its own); each bucket is one broadcast of a flat uint8 tensor.

How a transfer runs (free to change, the bytes on the wire stay the same): up to `PIPELINE_DEPTH` broadcasts
are in flight, so packing or unpacking one bucket overlaps the transfer of another; a bucket whose tensors
already lie in memory as the wire lays them out is sent or received in place, and the others go through
flat buffers that the group keeps and reuses across buckets and updates (`BucketBuffers`). The trainer keeps
its parameters laid out that way (`adopt_wire_layout`) and the embedded engine receives into buffers laid
out that way, so neither copies a byte of a bucketed update.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

log = logging.getLogger(__name__)

ALIGN = 16
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Broadcasts in flight at once: (un)packing one bucket overlaps the transfer of the one before it.
PIPELINE_DEPTH = 2


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
    buffers: BucketBuffers = field(default_factory=BucketBuffers, repr=False)
    send_plan: _SendPlan | None = field(default=None, repr=False)  # see broadcast_tensors
    _broadcast_options: dict[int, dist.BroadcastOptions] = field(default_factory=dict, repr=False)
    timeout_s: float = 120.0  # how long one broadcast may wait for its peers (see `_pipelined`)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast on the group's worker thread (gloo) or stream (nccl); `wait()` on the result.
        Keep `tensor` alive and unchanged until then."""
        opts = self._broadcast_options.get(src)
        if opts is None:  # made once: less Python per broadcast on a thread that shares the GIL with decoding
            opts = self._broadcast_options[src] = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device))

    def destroy(self) -> None:
        """Leave the group: unregister it from torch (so this process can form one under the same name again)
        and free it. Call it before the process exits: a group torn down during interpreter shutdown can abort
        the process from a C++ worker thread."""
        if self.pg is None:
            return
        pg, self.pg = self.pg, None  # type: ignore[assignment]
        _unregister(pg, self.group_name)
        self.store = None  # type: ignore[assignment]
        self.buffers.clear()
        self.send_plan = None
        gc.collect()


_live_groups: weakref.WeakSet[WeightUpdateGroup] = weakref.WeakSet()
# Per weight-update group, the names torch registers this process's members of it under (formed, or being
# formed): the group's own for the first, a name of its own for any other (torch takes one group per name in a
# process), e.g. a test's engine and trainer in one process, or a rank formed again while the earlier
# formation was never destroyed. torch keeps a group registered (and alive) until it is destroyed.
_members: dict[str, set[str]] = {}
_members_lock = threading.Lock()


@atexit.register
def _destroy_live_groups() -> None:
    for group in list(_live_groups):
        group.destroy()
    for group_name, members in list(_members.items()):
        for torch_name in list(members):
            pg = _registered(torch_name)
            if pg is not None:
                _unregister(pg, group_name)


def host_rendezvous(master_address: str, world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
    """Rank 0's store on a port the kernel picks (`.port`): nothing can take the port between choosing it and
    listening on it, which a port picked in advance cannot promise. Pass it to `init_weight_update_group`; the
    other members reach it through torch's tcp:// rendezvous at `master_address` and that port."""
    try:
        return dist.TCPStore(master_address, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, use_libuv=True)
    except Exception as e:
        raise _as_sync_error(e, f"rank 0 could not listen on {master_address}", timeout_s) from e


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update",
    timeout_s: float = 120.0,
    store: dist.TCPStore | None = None,
) -> WeightUpdateGroup:
    """Host (rank 0) or join (rank > 0) the group, as the module docstring describes; SGLang joins the same
    way with its own code. Rank 0 may pass the `store` it already hosts (see `host_rendezvous`). Over gloo it
    returns once every member has joined; over NCCL once this member has (the communicator is made at the
    first broadcast).

    Raises `WeightSyncTimeout` when some member does not join within `timeout_s`, `WeightSyncError` when the
    group cannot be formed (an unreachable address, a member that gave up).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    where = f"{master_address}:{store.port if store is not None else master_port}"
    torch_name = _reserve(group_name)
    try:
        try:
            if store is None:
                store = _connect(master_address, master_port, rank, world_size, timeout)
        except Exception as e:  # connection refused until rank 0 listens is retried inside; this is final
            raise _as_sync_error(e, f"rank {rank} could not reach the rendezvous of weight-update group "
                                    f"{group_name!r} at {where}", timeout_s,
                                 "check that rank 0 (the trainer) is up and this address is reachable from here") from e
        try:
            with _default_group_unbound():
                pg = _new_group(store, rank, world_size, backend, group_name, torch_name, timeout)
        except Exception as e:  # over gloo, this member waited here for the others
            error = _as_sync_error(e, f"rank {rank} could not form weight-update group {group_name!r} of "
                                      f"{world_size} at {where}", timeout_s,
                                   "check that every member joined with this group name, world size and backend")
            if isinstance(error, WeightSyncTimeout):
                error = WeightSyncTimeout(_not_joined(group_name, rank, world_size, where, timeout_s, e))
            raise error from e
    except BaseException:
        _forget(group_name, torch_name)
        raise
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    group = WeightUpdateGroup(pg, rank, world_size, backend, group_name, device, store, timeout_s=timeout_s)
    _live_groups.add(group)
    log.info("joined weight-update group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return group


JOIN_GRACE_S = 5.0  # how long past its `timeout_s` a bounded join may take to answer


def join_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             backend: str = "gloo", group_name: str = "weight_update", timeout_s: float = 120.0,
                             grace_s: float = JOIN_GRACE_S) -> WeightUpdateGroup:
    """`init_weight_update_group` for a member that must answer in bounded time (an engine's `init_group`): it
    returns, or raises, within `timeout_s` + `grace_s` however the rendezvous fails.

    Why: torch's TCPStore client retries a refused or unreachable address with backoff delays that run past the
    timeout it is given (68-79 s were seen past a 120 s one), and a peer that accepts and never answers (half open)
    or answers something else holds it longer still. The join runs on a daemon thread; past the deadline it is
    abandoned (`WeightSyncTimeout`), and the group it may still make later is destroyed at once, so the caller
    is left as it was. A daemon thread never holds up the process's exit."""
    lock, done = threading.Lock(), threading.Event()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            group = init_weight_update_group(master_address, master_port, rank, world_size, backend, group_name,
                                             timeout_s)
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            with lock:
                outcome["error"] = e
        else:
            with lock:
                abandoned = outcome.get("abandoned", False)
                outcome["group"] = group
            if abandoned:
                log.warning("a join of weight-update group %r that was given up on finished late; leaving it",
                            group_name)
                group.destroy()
        finally:
            done.set()

    threading.Thread(target=run, name="pipelinerl-join", daemon=True).start()
    if not done.wait(timeout_s + grace_s):
        with lock:
            outcome["abandoned"] = True
            late = outcome.get("group")
        if late is not None:  # finished while the deadline passed
            late.destroy()
        raise WeightSyncTimeout(f"rank {rank} could not join weight-update group {group_name!r} at "
                                f"{master_address}:{master_port} within timeout_s={timeout_s:g} (the rendezvous "
                                "was refused, unreachable, or answered by something else, or a member never came); "
                                "check that the trainer is up at that address and port")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["group"]  # type: ignore[return-value]


def _connect(master_address: str, master_port: int, rank: int, world_size: int,
             timeout: timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store (not waiting for the others in its constructor: forming the group does, and says
    which group timed out); the others reach it as SGLang's members do, through torch's tcp:// rendezvous."""
    if rank == 0:
        return dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, use_libuv=True)
    host = f"[{master_address}]" if ":" in master_address else master_address  # an IPv6 literal
    store, _, _ = next(distributed_c10d.rendezvous(f"tcp://{host}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    return store


def _new_group(store: dist.Store, rank: int, world_size: int, backend: str, group_name: str, torch_name: str,
               timeout: timedelta) -> dist.ProcessGroup:
    """The group, made exactly as SGLang's `init_custom_process_group` makes it from its rendezvous store:
    torch's helper keys the store under the name it registers the group by, so a member registered under
    another name (`_reserve`) sees its keys renamed back to the group's."""
    prefixed: dist.Store = dist.PrefixStore(group_name, store)
    if torch_name != group_name:
        prefixed = _RenamedStore(prefixed, f"{torch_name}/", f"{group_name}/")
    helper = distributed_c10d._new_process_group_helper
    # torch 2.6 renamed the helper's `pg_options` to `backend_options`: ask the signature, not the version
    options = "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
    pg, _ = helper(world_size, rank, [], dist.Backend(backend), prefixed, group_name=torch_name, timeout=timeout,
                   **{options: None})
    # The helper registers no rank mapping for a group made this way; destroy_process_group and the
    # group-relative collectives (dist.broadcast(..., group=pg), which SGLang uses) need one.
    distributed_c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    return pg


class _RenamedStore(dist.Store):
    """`store` with keys starting with `old` given `new` instead."""

    def __init__(self, store: dist.Store, old: str, new: str):
        super().__init__()
        self._store, self._old, self._new = store, old, new

    def _key(self, key: str) -> str:
        return self._new + key[len(self._old):] if key.startswith(self._old) else key

    def set(self, key, value):
        self._store.set(self._key(key), value)

    def get(self, key):
        return self._store.get(self._key(key))

    def add(self, key, value):
        return self._store.add(self._key(key), value)

    def check(self, keys):
        return self._store.check([self._key(k) for k in keys])

    def wait(self, keys, timeout=None):
        keys = [self._key(k) for k in keys]
        return self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        return self._store.compare_set(self._key(key), expected, desired)

    def delete_key(self, key):
        return self._store.delete_key(self._key(key))

    def num_keys(self):
        return self._store.num_keys()

    def set_timeout(self, timeout):
        self._store.set_timeout(timeout)


@contextmanager
def _default_group_unbound() -> Iterator[None]:
    """While the group is made, this process's default group (if any) bound to no device.

    A default group bound to a device (DeepSpeed binds every rank's on CUDA) makes torch make each new NCCL
    group by splitting the default group's communicator: a collective of the default group's ranks, of whom
    the weight-update group has one, and that the engines never join. It would hang. Unbound, the group gets
    a communicator of its own, made as every other member makes its own."""
    default = distributed_c10d._world.default_pg
    bound = default.bound_device_id if default is not None else None
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def _reserve(group_name: str) -> str:
    """The name torch is to register this process's next member of `group_name` under (see `_members`), taken
    before any network work. A torch group of that name not formed here is an error."""
    with _members_lock:
        members = _members.setdefault(group_name, set())
        registered = set(distributed_c10d._world.pg_names.values())
        if group_name in registered - members:
            raise WeightSyncError(f"this process already has a torch process group named {group_name!r}, not a "
                                  "weight-update group; choose another weight_sync.group_name")
        torch_name, k = group_name, 1
        while torch_name in members | registered:
            torch_name, k = f"{group_name}@{k}", k + 1
        members.add(torch_name)
        return torch_name


def _forget(group_name: str, torch_name: str) -> None:
    with _members_lock:
        _members.get(group_name, set()).discard(torch_name)


def _registered(torch_name: str) -> dist.ProcessGroup | None:
    return next((pg for pg, name in distributed_c10d._world.pg_names.items() if name == torch_name), None)


def _unregister(pg: dist.ProcessGroup, group_name: str) -> None:
    torch_name = distributed_c10d._world.pg_names.get(pg)
    if torch_name is None:
        return
    _forget(group_name, torch_name)
    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # the group is dropped either way; a peer that already left can make shutdown fail
        log.warning("weight-update group %r: destroying it: %s", group_name, e)


def _not_joined(group_name: str, rank: int, world_size: int, where: str, timeout_s: float, e: Exception) -> str:
    return (f"weight-update group {group_name!r} (world size {world_size}, rendezvous at {where}): rank {rank} "
            f"waited {timeout_s:g}s for members that did not join ({_first_line(e)}); check that every engine was "
            "asked to join (its log says why it did not), that it can reach this address and port, and that every "
            "member was given this group name and world size (each engine's tensor-parallel workers are one rank "
            "each)")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _as_sync_error(e: Exception, what: str, timeout_s: float, hint: str = "") -> WeightSyncError:
    text = _first_line(e)
    hint = f"; {hint}" if hint else ""
    if "timeout" in text.lower() or "timed out" in text.lower():
        return WeightSyncTimeout(f"{what} within {timeout_s:g}s: {text}{hint}")
    return WeightSyncError(f"{what}: {text}{hint}")


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
    return _as_sync_error(e, f"broadcast in group {group.group_name!r} failed", group.timeout_s,
                          "a member died, stalled or refused the update; the engines' logs say which")


@dataclass(frozen=True)
class _Bucket:
    """One broadcast of an update: its tensors, where each starts in it, its size in bytes."""

    indices: list[int]
    offsets: list[int]
    nbytes: int


def _layout(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[_Bucket]:
    """`plan_buckets` with the byte offsets of the wire format (per tensor: offset 0, its own size)."""
    buckets = []
    for indices in plan_buckets(specs, bucket_bytes):
        if bucket_bytes <= 0:
            buckets.append(_Bucket(indices, [0], specs[indices[0]].nbytes))
            continue
        offsets = []
        size = 0
        for i in indices:
            offsets.append(size)
            size += _aligned(specs[i].nbytes)
        buckets.append(_Bucket(indices, offsets, size))
    return buckets


def wire_buffers(specs: Sequence[TensorSpec], bucket_bytes: int = 0,
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Empty tensors for `specs`, laid out in memory as the wire format lays them out: one flat buffer per
    bucket, padding included, each tensor a view into it. `receive_tensors` receives a bucket straight into
    such tensors, with no unpacking copy (keep them across updates, so that no update allocates), and
    `broadcast_tensors` sends a bucket straight from them (e.g. parameters re-pointed into them), with no
    packing copy."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    for bucket in _layout(specs, bucket_bytes):
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for i, offset in zip(bucket.indices, bucket.offsets):
            spec = specs[i]
            out[i] = flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
    return out


def sibling_order(names: Sequence[str]) -> list[int]:
    """An order for sending the parameters `names` (their indices) that puts the same parameter of sibling
    modules back to back: `attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
    attn.q_proj.bias, ...` instead of each module's weight and bias together. Inference engines fuse sibling
    projections (q/k/v, gate/up) into one buffer of their weights stacked, so in this order such a buffer
    arrives as one piece of a bucket and can be received in place instead of copied out of it. Otherwise the
    order is kept (parents, and parameter names within a parent, in order of first appearance)."""
    parents: dict[str, int] = {}
    kinds: dict[tuple[str, str], int] = {}
    keys = []
    for i, name in enumerate(names):
        module, _, attr = name.rpartition(".")
        parent = module.rpartition(".")[0]
        keys.append((parents.setdefault(parent, len(parents)), kinds.setdefault((parent, attr), len(kinds)), i))
    return [i for _, _, i in sorted(keys)]


def in_wire_layout(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> bool:
    """Whether every bucket of `tensors` can be sent from (or received into) their own memory, as after
    `adopt_wire_layout`: then an update needs no packing or unpacking copy."""
    if not tensors:
        return True
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
    device = tensors[0].device
    return all(_wire_view(tensors, specs, b, device) is not None for b in _layout(specs, bucket_bytes))


@torch.no_grad()
def adopt_wire_layout(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[torch.Tensor]:
    """Move `tensors` (all on one device) into memory laid out as the wire format lays them out: each keeps
    its values and identity (an `nn.Parameter` stays the same parameter, its optimizer state still keyed to
    it) but its `.data` becomes a view into one flat buffer per bucket. Returns the flat buffers, padding
    zeroed. Tensors that share a flat buffer share a storage: anything that saves them must not deduplicate
    by storage (safetensors does)."""
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
    views = wire_buffers(specs, bucket_bytes, tensors[0].device if tensors else "cpu")
    flats: dict[int, torch.Tensor] = {}
    for view in views:
        storage = view.untyped_storage()
        if storage.data_ptr() not in flats:
            flats[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage).zero_()
    for t, view in zip(tensors, views):
        view.copy_(t)
        t.data = view
    return list(flats.values())


def _wire_view(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], bucket: _Bucket,
               device: torch.device) -> torch.Tensor | None:
    """The bucket as a flat uint8 view of the tensors' own memory when they already lie there as the wire
    format lays them out, so it is broadcast with no packing or unpacking copy; None otherwise.

    That is one tensor of exactly the bucket's size (any contiguous tensor whose size is a multiple of
    `ALIGN`), or views into one storage that holds this bucket and nothing else (what `wire_buffers` makes):
    receiving writes the padding too, so memory that is not the bucket's own must never be taken for it.
    """
    members = [tensors[i] for i in bucket.indices]
    for t, i in zip(members, bucket.indices):
        if t.device != device or t.dtype != specs[i].dtype or tuple(t.shape) != specs[i].shape \
                or not t.is_contiguous():
            return None
    first = members[0]
    if len(members) == 1 and first.numel() * first.element_size() == bucket.nbytes:
        return first.reshape(-1).view(torch.uint8)
    storage = first.untyped_storage()
    if storage.nbytes() != bucket.nbytes:
        return None
    base = storage.data_ptr()
    for t, offset in zip(members, bucket.offsets):
        if t.untyped_storage().data_ptr() != base or t.data_ptr() != base + offset:
            return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (bucket.nbytes,))


def _pack(sources: Sequence[torch.Tensor], specs: Sequence[TensorSpec], bucket: _Bucket,
          flat: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into `flat` at their offsets: one copy each, whatever their device or
    strides, by viewing the destination bytes as the tensor's dtype and shape."""
    for i, offset in zip(bucket.indices, bucket.offsets):
        spec = specs[i]
        flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(sources[i])
    return flat


def _unpack(received: torch.Tensor, specs: Sequence[TensorSpec], bucket: _Bucket,
            result: list[torch.Tensor]) -> None:
    flat = received.reshape(-1).view(torch.uint8)
    for i, offset in zip(bucket.indices, bucket.offsets):
        spec = specs[i]
        result[i].copy_(flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape))


def _on_wire(flat: torch.Tensor, specs: Sequence[TensorSpec], bucket: _Bucket, bucket_bytes: int) -> torch.Tensor:
    """What is broadcast for a bucket: its flat bytes, or with `bucket_bytes` = 0 its one tensor in its own
    dtype and shape (what SGLang receives)."""
    if bucket_bytes > 0:
        return flat
    spec = specs[bucket.indices[0]]
    return flat.view(spec.dtype).view(spec.shape)


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


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
