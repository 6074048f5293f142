"""The weight-update group between independently started processes over loopback (gloo)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipelinerl.procs import free_port
from pipelinerl.weight_sync import TensorSpec, adopt_wire_layout, in_wire_layout, plan_buckets

PEER = str(Path(__file__).with_name("weight_sync_peer.py"))


def start_peers(ranks, world, port, tmp_path, timeout=60.0):  # generous: peers import torch at once
    procs = {}
    for r in ranks:
        out = tmp_path / f"rank{r}.json"
        procs[r] = (subprocess.Popen([sys.executable, PEER, str(r), str(world), str(port), str(out), str(timeout)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)
    return procs


def test_three_processes_receive_every_dtype_and_shape_bit_exactly(tmp_path):
    procs = start_peers([0, 1, 2], 3, free_port(), tmp_path)
    results = {}
    for r, (p, out) in procs.items():
        log = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 0, f"rank {r} failed:\n{log}"
        results[r] = json.loads(out.read_text())
    for r in (1, 2):
        for bucket_bytes in ("0", "256", "1048576", "256-laid", "1048576-laid"):
            got = results[r][bucket_bytes]
            assert got["got"] == results[r]["expected"], f"rank {r}, bucket_bytes {bucket_bytes}"
            assert got["arrived"] == list(range(6)), "on_bucket reports every tensor once, in order"
            assert got["dtypes"] == ["torch.float32", "torch.bfloat16", "torch.float16", "torch.float32",
                                     "torch.bfloat16", "torch.float32"]
            assert got["shapes"] == [[3, 5], [7], [2, 2, 3], [1000], [64, 33], [1]]


def test_a_peer_that_never_joins_is_a_clear_timeout(tmp_path):
    # 15 s: the two peers start together but import torch on a shared machine, so they may reach the group
    # seconds apart; the message must still name only the rank that never comes
    start = time.monotonic()
    procs = start_peers([0, 1], 3, free_port(), tmp_path, timeout=15.0)
    for p, out in procs.values():
        p.communicate(timeout=60)
        assert p.returncode == 3
        result = json.loads(out.read_text())
        assert result["error"] == "WeightSyncTimeout"
        assert "rank(s) [2]" in result["message"] and "did not join" in result["message"]
    assert time.monotonic() - start < 90  # ended by the timeout, not by the test's own limit


def test_bucket_plan_groups_consecutive_tensors_within_the_limit():
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([4, 4, 100, 1, 1])]
    # 16-byte aligned sizes: 16, 16, 400, 16, 16
    assert plan_buckets(specs, 0) == [[0], [1], [2], [3], [4]]
    assert plan_buckets(specs, 32) == [[0, 1], [2], [3, 4]]
    assert plan_buckets(specs, 1 << 20) == [[0, 1, 2, 3, 4]]


def test_adopting_the_wire_layout_keeps_values_and_parameters():
    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7).bfloat16()),
              torch.nn.Parameter(torch.randn(100))]
    values = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    assert in_wire_layout(params, 0) and not in_wire_layout(params, 256)
    flats = adopt_wire_layout(params, 256)
    # 16-byte aligned: 64 + 16 (7 bf16 = 14 bytes, padded) in one bucket, 400 in its own
    assert [f.numel() for f in flats] == [80, 400]
    assert in_wire_layout(params, 256) and not in_wire_layout(params, 1 << 20)
    assert [id(p) for p in params] == ids and all(isinstance(p, torch.nn.Parameter) for p in params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert flats[0][78:].tolist() == [0, 0], "padding is zeroed, so the bytes on the wire are deterministic"
    with torch.no_grad():
        params[1].add_(1)  # an in-place update (what the optimizer does) lands in the flat buffer
    assert torch.equal(flats[0][64:78].view(torch.bfloat16), params[1])


def test_bad_arguments_are_rejected_before_any_network_work():
    from pipelinerl.weight_sync import init_weight_update_group

    with pytest.raises(ValueError, match="backend"):
        init_weight_update_group("127.0.0.1", free_port(), 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank 2"):
        init_weight_update_group("127.0.0.1", free_port(), 2, 2)


def test_rank_zero_can_host_on_a_port_the_kernel_picks():
    """master_port 0: rank 0 listens first and hands the port to the others, so no one can take it in between."""
    import threading

    from pipelinerl.weight_sync import host_rendezvous, init_weight_update_group

    store = host_rendezvous("127.0.0.1", world_size=2, timeout_s=30)
    assert store.port > 0
    groups = {}
    peer = threading.Thread(target=lambda: groups.setdefault(1, init_weight_update_group(
        "127.0.0.1", store.port, 1, 2, group_name="picked_port", timeout_s=30)))
    peer.start()
    groups[0] = init_weight_update_group("127.0.0.1", store.port, 0, 2, group_name="picked_port", timeout_s=30,
                                         store=store)
    peer.join(timeout=30)
    assert set(groups) == {0, 1}
    for g in groups.values():
        g.destroy()
