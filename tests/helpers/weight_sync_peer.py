"""One member of a weight-update group, started as its own process by tests/test_weight_sync.py.

Rank 0 broadcasts seeded tensors of several dtypes and shapes (both wire formats); other ranks receive them
and write sha256 digests of what they got, next to the digests of what they should have got, to a JSON file.
Every rank has a default group of its own, rank 0's bound to a device as DeepSpeed binds a trainer rank's.
"""

import hashlib
import json
import sys

import torch

from pipelinerl.weight_sync import (
    TensorSpec,
    WeightSyncError,
    adopt_wire_layout,
    broadcast_tensors,
    in_wire_layout,
    init_weight_update_group,
    receive_tensors,
)


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, 3, generator=g).to(torch.float16),
        torch.randn(1000, generator=g),
        torch.randn(64, 33, generator=g).to(torch.bfloat16),
        torch.randn(1, generator=g),
    ]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_path, timeout = sys.argv[4], float(sys.argv[5])
    # A default group of this process's own, to show the weight-update group lives beside it.
    own_store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=own_store, rank=0, world_size=1)
    if rank == 0:
        torch.distributed.group.WORLD.bound_device_id = torch.device("cpu", 0)
    result: dict = {"rank": rank}
    try:
        group = init_weight_update_group("127.0.0.1", port, rank, world, "gloo", "test_group", timeout_s=timeout)
    except WeightSyncError as e:
        result.update(error=type(e).__name__, message=str(e))
        json.dump(result, open(out_path, "w"))
        return 3
    # unbound only while the group was made (an NCCL group would be split from the default one otherwise)
    result["default_group_device"] = str(torch.distributed.group.WORLD.bound_device_id)
    expected = tensors()
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(expected)]
    # "-laid": the sender's tensors laid out as the wire lays them out (as the trainer's parameters are), so
    # every bucket is sent from their own memory
    for key, bucket_bytes in (("0", 0), ("256", 256), ("1048576", 1 << 20), ("256-laid", 256),
                              ("1048576-laid", 1 << 20)):
        if rank == 0:
            sources = expected
            if key.endswith("-laid"):
                sources = [t.clone() for t in expected]
                adopt_wire_layout(sources, bucket_bytes)
                assert in_wire_layout(sources, bucket_bytes)
            broadcast_tensors(group, sources, bucket_bytes)
        else:
            arrived: list[int] = []
            got = receive_tensors(group, specs, bucket_bytes, on_bucket=arrived.extend)
            result[key] = {"got": [digest(t) for t in got], "dtypes": [str(t.dtype) for t in got],
                           "shapes": [list(t.shape) for t in got], "arrived": arrived}
    result["expected"] = [digest(t) for t in expected]
    torch.distributed.all_reduce(torch.ones(1))  # the default group still works
    group.destroy()
    torch.distributed.destroy_process_group()
    json.dump(result, open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
