"""Double-buffered weights for the embedded engine's in-flight updates.

An update is received into a spare copy of the weights' storage while decoding goes on; the switch then swaps
spare and live storage tensor by tensor, so the decode pause is microseconds per tensor whatever the model
size, instead of a copy of every weight.

A bucketed update is received into an *arena*: flat buffers laid out as the wire lays the update out
(`wire_buffers`), so every bucket lands with no unpacking copy. Wherever a weight's storage can simply be a
piece of the arena (a parameter on its own, or a fused buffer whose members arrive back to back, like the
runner's q/k/v rows in the trainer's `sibling_order`) the spare *is* that piece and the switch makes it live.
A tensor alone in its bucket is received straight into its spare wherever that is. What is left (a fused
buffer whose members the wire interleaves with other tensors or splits across buckets) is copied out of the
arena into its spare as each bucket arrives, overlapped with the rest of the transfer. Two arenas per update
layout take turns, so steady-state updates allocate nothing: the one being received into is never one the
live weights point into. A new layout (another bucket size or parameter list) gets new arenas; the old ones
are freed once no weight points into them.

The same bookkeeping serves an engine that receives in a process of its own (`receiving_process.py`): there every
allocation is in shared memory (`shared=True`), the receiving process runs `staging` and tells the engine where
each storage's spare lies (`spares_of`), the engine takes those spares (`take_spares`) and switches, and the
receiving process mirrors the switch without copying a byte (`switch(copy_members=False)`), so that both
agree on which memory is live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipelinerl.weight_sync import ALIGN, TensorSpec, plan_buckets, wire_buffers

# A fused buffer's members: (parameter, first row, end row); rows are None for a parameter on its own.
Member = tuple[torch.Tensor, int | None, int | None]
ARENAS_PER_LAYOUT = 2


class _Storage:
    """One tensor whose storage a switch replaces: a parameter, or a buffer several parameters are row slices
    of (the runner's fused q/k/v and gate/up). The spare is a clone made at the first update that needs one,
    so rows no member covers stay right."""

    def __init__(self, live: torch.Tensor, members: list[Member], shared: bool = False):
        self.live, self.members, self.shared = live, members, shared
        self.current = live.detach()  # what `live` holds now; the next spare after a swap
        self.spare: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # (of spare, rows)
        self._rows_of: dict[int, tuple] = {}  # the rows made for each of the last spares, by id: they take turns

    def spare_view(self, member: int) -> torch.Tensor:
        if self.spare is None:
            self.spare = self.live.detach().clone()
            if self.shared:
                self.spare.share_memory_()
        _, start, end = self.members[member]
        return self.spare if start is None else self.spare[start:end]

    def arena_region(self, received: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """This storage as one piece of an arena, given where each member was received (`received`: member
        -> arena tensor), or None when the members do not lie there exactly as this storage lays them out:
        all of them, back to back in row order, covering every row."""
        live = self.live
        if len(received) != len(self.members):
            return None
        if any(t.device != live.device for t in received.values()):  # received elsewhere: copied in instead
            return None
        if self.members[0][1] is None:  # a parameter on its own
            t = received[0]
            return t if (t.dtype, t.shape) == (live.dtype, live.shape) else None
        if not live.is_contiguous():
            return None
        first = received[min(received, key=lambda m: self.members[m][1])]
        row, address = 0, first.data_ptr()
        for m in sorted(received, key=lambda m: self.members[m][1]):
            t, (_, start, end) = received[m], self.members[m]
            if start != row or t.dtype != live.dtype or t.shape != live[start:end].shape \
                    or t.data_ptr() != address \
                    or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                return None
            row, address = end, address + t.numel() * t.element_size()
        if row != live.shape[0]:
            return None
        return torch.empty(0, dtype=live.dtype, device=live.device).set_(
            first.untyped_storage(), first.storage_offset(), live.shape, live.stride())

    def prepare_swap(self) -> None:
        """Make the members' row views of the spare now, on the receiving thread: the swap then only assigns,
        which keeps the decode pause short (a switch runs with cold caches, right after a transfer)."""
        spare = self.spare
        assert spare is not None
        rows = self._rows_of.get(id(spare))
        if rows is None or rows[0] is not spare:
            if len(self._rows_of) >= 2 * ARENAS_PER_LAYOUT:
                self._rows_of.clear()
            rows = self._rows_of[id(spare)] = (
                spare, [(param, spare[start:end]) for param, start, end in self.members if start is not None])
        self._rows = rows

    def swap(self) -> None:
        """Make the spare live and the live storage the next spare: assignments, no copy."""
        if self._rows is None or self._rows[0] is not self.spare:
            self.prepare_swap()
        old = self.current if self.current.data_ptr() == self.live.data_ptr() else self.live.detach()
        self.live.data = self.spare
        for param, rows in self._rows[1]:
            param.data = rows
        self.current, self.spare, self._rows = self.spare, old, None

    def copy_member(self, member: int) -> None:
        with torch.no_grad():
            self.members[member][0].copy_(self.spare_view(member))


@dataclass
class StagingPlan:
    """Where one update is received (`targets`, one per spec) and what is copied out of there afterwards:
    `copies` maps a spec index to the spare it belongs in. Pass `after_bucket` to `receive_tensors`: it also
    prepares the switch (`to_prepare`) while the rest of the update is still arriving."""

    targets: list[torch.Tensor]
    copies: dict[int, torch.Tensor] = field(default_factory=dict)
    to_prepare: list[_Storage] = field(default_factory=list)

    def after_bucket(self, indices: list[int]) -> None:
        # No torch.no_grad(): nothing here requires grad (spares are detached), and on the receiving thread its
        # Python (a decorator's context manager per bucket) is GIL time taken from decoding.
        for i in indices:
            spare = self.copies.get(i)
            if spare is not None:
                spare.copy_(self.targets[i])
        for storage in self.to_prepare:
            storage.prepare_swap()
        self.to_prepare = []


@dataclass
class _Arena:
    """Flat buffers laid out as one update layout's wire (`targets`: one view per spec); `regions`: the
    storages whose spare is a piece of it; of the others' members, (storage, member, spec index), those
    received straight into their spare (`direct`) and those copied there from the arena (`copied`)."""

    targets: list[torch.Tensor]
    regions: list[tuple[_Storage, torch.Tensor]] = field(default_factory=list)
    direct: list[tuple[_Storage, int, int]] = field(default_factory=list)
    copied: list[tuple[_Storage, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flats = frozenset(t.untyped_storage().data_ptr() for t in self.targets)


class SpareWeights:
    """The spare side of every weight, and the switch that makes it live.

    Reusing a spare or an arena is safe: the next update cannot start receiving before the switch that made
    the previous one live is done (the engine holds its update lock until then), and an arena is received
    into only when no live weight points into it."""

    def __init__(self, params: dict[str, torch.Tensor], fused_groups: list, shared: bool = False) -> None:
        """`shared`: allocate spares and arenas in shared memory, for a receiving process (`receiving_process.py`)."""
        self._shared = shared
        where: dict[int, tuple[_Storage, int]] = {}
        for buffer, members in fused_groups:
            storage = _Storage(buffer, list(members), shared)
            for i, (param, _, _) in enumerate(members):
                where[id(param)] = (storage, i)
        self._where: dict[str, tuple[_Storage, int]] = {}
        for name, param in params.items():  # tied parameters share one entry
            if id(param) not in where:
                where[id(param)] = (_Storage(param, [(param, None, None)], shared), 0)
            self._where[name] = where[id(param)]
        # Built in the same order from the same parameters, two processes number the storages alike
        self._storages = list({id(s): s for s, _ in self._where.values()}.values())
        self._index = {id(s): i for i, s in enumerate(self._storages)}
        self._arena_layout: tuple | None = None
        self._arenas: list[_Arena] = []
        self._switch_key: tuple[str, ...] | None = None
        self._switch_cached: list[tuple[_Storage, bool, set[int]]] = []

    def staging(self, specs: Sequence[TensorSpec], bucket_bytes: int) -> StagingPlan:
        """Where to receive an update of `specs` (checked against the model) so that `switch` makes it live.

        Always on the weights' own device, whatever the group's: a gloo group moves the bytes through host
        memory, and on a GPU `receive_tensors` copies each bucket from there into these (a spare on the host
        would otherwise become a live weight on the wrong device at the switch)."""
        device = self._storages[0].live.device
        if bucket_bytes <= 0:  # per tensor: each tensor is its own broadcast, received straight into its spare
            plan = StagingPlan([self._where[s.name][0].spare_view(self._where[s.name][1]) for s in specs])
        else:
            arena = self._free_arena(specs, bucket_bytes, device)
            for storage, region in arena.regions:
                storage.spare = region
            targets = list(arena.targets)
            for storage, m, i in arena.direct:
                targets[i] = storage.spare_view(m)
            plan = StagingPlan(targets, {i: storage.spare_view(m) for storage, m, i in arena.copied})
        plan.to_prepare = [storage for storage, whole, _ in self._switch_plan([s.name for s in specs]) if whole]
        return plan

    def _free_arena(self, specs: Sequence[TensorSpec], bucket_bytes: int, device: torch.device) -> _Arena:
        """An arena for this update's layout that no live weight points into; allocated only the first times
        a layout is seen (a new layout drops the old layout's arenas once nothing uses them)."""
        layout = (bucket_bytes, str(device), tuple((s.name, s.dtype, s.shape) for s in specs))
        if layout != self._arena_layout:
            self._arena_layout, self._arenas = layout, []
        live = {s.live.untyped_storage().data_ptr() for s in self._storages}
        for arena in self._arenas:
            if arena.flats.isdisjoint(live):
                return arena
        arena = self._new_arena(specs, bucket_bytes, device)
        self._arenas = [*self._arenas[-(ARENAS_PER_LAYOUT - 1):], arena]
        return arena

    def _new_arena(self, specs: Sequence[TensorSpec], bucket_bytes: int, device: torch.device) -> _Arena:
        """Allocate an arena and work out, once, which storages can be pieces of it."""
        targets = wire_buffers(specs, bucket_bytes, device)
        if self._shared:
            for t in targets:  # before anything notes where they lie: sharing moves the memory
                t.share_memory_()
        arena = _Arena(targets)
        received: dict[int, tuple[_Storage, dict[int, int]]] = {}  # storage -> {member: spec index}
        for i, spec in enumerate(specs):
            storage, member = self._where[spec.name]
            received.setdefault(id(storage), (storage, {}))[1][member] = i
        # A tensor alone in its bucket, with no padding, is received wherever it is asked to be: straight into
        # its spare, even a row slice of a fused buffer split across buckets.
        alone = {b[0] for b in plan_buckets(specs, bucket_bytes) if len(b) == 1 and specs[b[0]].nbytes % ALIGN == 0}
        for storage, members in received.values():
            region = storage.arena_region({m: arena.targets[i] for m, i in members.items()})
            if region is not None:
                arena.regions.append((storage, region))
                continue
            for m, i in members.items():
                (arena.direct if i in alone else arena.copied).append((storage, m, i))
        return arena

    def switch(self, names: list[str], copy_members: bool = True) -> None:
        """Make the received tensors of `names` live. Call between decode steps only. Without `copy_members`
        (a receiving process mirroring the engine's switch), rows of a fused buffer that the update covers only
        in part are left for the engine to copy: only the bookkeeping of what is live changes."""
        for storage, whole, members in self._switch_plan(names):
            if whole:
                storage.swap()
            elif copy_members:
                for member in members:
                    storage.copy_member(member)

    def spares_of(self, names: list[str]) -> list[tuple[int, torch.Tensor]]:
        """(storage number, its spare) of every storage that `switch(names)` changes: once a staging for these
        names is received, where each holds the new values (a receiving process tells the engine this)."""
        return [(self._index[id(storage)], storage.spare) for storage, _, _ in self._switch_plan(names)]

    def take_spares(self, names: list[str], spares: dict[int, torch.Tensor]) -> None:
        """Take the spares that another process received `names` into (its `spares_of`), so that
        `switch(names)` makes them live, and prepare the switch."""
        for storage, whole, _ in self._switch_plan(names):
            storage.spare = spares[self._index[id(storage)]]
            if whole:
                storage.prepare_swap()

    def incoming(self, names: list[str]) -> dict[int, tuple[torch.Tensor | None, list[int]]]:
        """What `switch(names)` will do to each weight it changes, keyed by id() of the live tensor (a
        parameter, or a fused buffer): (the received tensor it will make live, the same memory and values,
        or None where it copies some rows into the live tensor instead; the indices in `names` of its
        pieces). Valid once a `staging` for these names was made; the tensor holds the new values once its
        pieces are received. Lets the runner prepare for the new weights while decoding goes on with the old."""
        pieces: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            pieces.setdefault(id(self._where[name][0]), []).append(i)
        return {id(storage.live): (storage.spare if whole else None, pieces[id(storage)])
                for storage, whole, _ in self._switch_plan(names)}

    def _switch_plan(self, names: list[str]) -> list[tuple[_Storage, bool, set[int]]]:
        """(storage, whether `names` cover it whole, the members they cover) per storage they touch: a
        storage covered whole is swapped, the others copied member by member. Kept for the last list of
        names (every update of a run names the same parameters)."""
        key = tuple(names)
        if key != self._switch_key:
            covered: dict[int, tuple[_Storage, set[int]]] = {}
            for name in names:
                storage, member = self._where[name]
                covered.setdefault(id(storage), (storage, set()))[1].add(member)
            self._switch_key = key
            self._switch_cached = [(storage, len(members) == len(storage.members), members)
                                   for storage, members in covered.values()]
        return self._switch_cached
