"""The weight-update process group between a trainer (rank 0) and independently started inference processes,
and how an update's tensors travel over it.

- `group`: forming the group (rendezvous, joining within a bound, torch's registration of it, leaving it).
- `wire`: the wire format of an update (the inference contract refers to it): buckets, offsets, memory laid
  out that way, packing and unpacking.
- `transfer`: moving an update over a group: pipelined broadcasts, reused buffers, streams.
- `errors`: what forming the group or a transfer raises.

Everything other code uses is imported from here, `pipelinerl.weight_sync`.
"""

from pipelinerl.weight_sync.errors import WeightSyncError, WeightSyncTimeout
from pipelinerl.weight_sync.group import (
    JOIN_GRACE_S,
    WeightUpdateGroup,
    host_rendezvous,
    init_weight_update_group,
    join_weight_update_group,
)
from pipelinerl.weight_sync.transfer import (
    PIPELINE_DEPTH,
    BucketBuffers,
    broadcast_stream,
    broadcast_tensors,
    drain,
    receive_stream,
    receive_tensors,
)
from pipelinerl.weight_sync.wire import (
    ALIGN,
    DTYPE_NAMES,
    DTYPES,
    TensorSpec,
    adopt_wire_layout,
    in_wire_layout,
    plan_buckets,
    sibling_order,
    total_bytes,
    wire_buffers,
)

__all__ = [
    "ALIGN",
    "BucketBuffers",
    "DTYPES",
    "DTYPE_NAMES",
    "JOIN_GRACE_S",
    "PIPELINE_DEPTH",
    "TensorSpec",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WeightUpdateGroup",
    "adopt_wire_layout",
    "broadcast_stream",
    "broadcast_tensors",
    "drain",
    "host_rendezvous",
    "in_wire_layout",
    "init_weight_update_group",
    "join_weight_update_group",
    "plan_buckets",
    "receive_stream",
    "receive_tensors",
    "sibling_order",
    "total_bytes",
    "wire_buffers",
]
