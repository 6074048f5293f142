"""The wire format of one update (the inference contract refers to this): the sender broadcasts the tensors in
the order of the spec list, from rank 0.
- `bucket_bytes == 0`: one broadcast per tensor, in the tensor's own dtype and shape (what SGLang expects).
- `bucket_bytes > 0`: tensors are laid out back to back as raw bytes, each starting at an offset rounded up
  to `ALIGN` bytes; consecutive tensors are grouped greedily into buckets of at most `bucket_bytes` (a tensor
  larger than that is a bucket of its own); each bucket is one broadcast of a flat uint8 tensor.

Here: the layout (which tensors go in which bucket, at which offset), memory laid out that way
(`wire_buffers`, `adopt_wire_layout`), and packing tensors into a bucket's bytes and out of them. Nothing here
touches the process group; `transfer` moves the buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 16
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


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


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
