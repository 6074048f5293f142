"""Forming the weight-update process group: a torch.distributed group between a trainer (rank 0) and inference
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
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# A group keeps its transfers' state (reused buffers, the last send plan): this module imports `transfer`, which
# names the group in its type hints only.
from pipelinerl.weight_sync.errors import WeightSyncError, WeightSyncTimeout, _as_sync_error, _first_line
from pipelinerl.weight_sync.transfer import BucketBuffers, _SendPlan

# The package's name, as before it was split into modules: log lines (their %(name)s) and filters stay the same.
log = logging.getLogger("pipelinerl.weight_sync")


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
