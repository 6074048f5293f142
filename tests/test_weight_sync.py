"""The weight-update group between independently started processes over loopback (gloo), as this package
forms it and as SGLang joins it."""

import hashlib
import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipelinerl.procs import free_port
from pipelinerl.weight_sync import (
    TensorSpec,
    WeightSyncError,
    WeightSyncTimeout,
    adopt_wire_layout,
    broadcast_tensors,
    host_rendezvous,
    in_wire_layout,
    init_weight_update_group,
    plan_buckets,
    receive_tensors,
)

PEER = str(Path(__file__).parent / "helpers" / "weight_sync_peer.py")
STANDIN = str(Path(__file__).parent / "helpers" / "sglang_standin.py")


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
    assert results[0]["default_group_device"] == "cpu:0", "the trainer's default group is bound again"


def test_a_member_that_never_joins_is_a_timeout_naming_the_group():
    """Rank 0 (as the trainer hosts it) with no one coming: a timeout within the timeout, saying which group,
    where, and what to check; nothing is left registered, so the same name can be tried again at once."""
    for _ in range(2):
        store = host_rendezvous("127.0.0.1", world_size=2, timeout_s=2)
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout) as err:
            init_weight_update_group("127.0.0.1", store.port, 0, 2, "gloo", "lonely_group", timeout_s=2, store=store)
        assert time.monotonic() - start < 6
        message = str(err.value)
        for needle in ("'lonely_group'", "world size 2", f"127.0.0.1:{store.port}", "did not join",
                       "check that every engine was asked to join"):
            assert needle in message, message
    # a member whose rank 0 is not there: the same, from its side
    port = free_port()
    with pytest.raises(WeightSyncError) as err:
        init_weight_update_group("127.0.0.1", port, 1, 2, "gloo", "lonely_group", timeout_s=2)
    for needle in ("rank 1 could not reach the rendezvous", "'lonely_group'", f"127.0.0.1:{port}", "trainer"):
        assert needle in str(err.value), str(err.value)


def test_members_waiting_for_a_member_that_never_comes_all_fail_naming_the_group(tmp_path):
    # the two peers start together but import torch on a shared machine, so they may reach the group seconds
    # apart; both must still end by the timeout, not hang
    start = time.monotonic()
    procs = start_peers([0, 1], 3, free_port(), tmp_path, timeout=8.0)
    for r, (p, out) in procs.items():
        p.communicate(timeout=60)
        assert p.returncode == 3
        result = json.loads(out.read_text())
        assert "'test_group'" in result["message"], result
        if r == 0:
            assert result["error"] == "WeightSyncTimeout" and "world size 3" in result["message"], result
    assert time.monotonic() - start < 45  # ended by the timeout, not by the test's own limit


def test_a_process_joining_as_sglang_does_receives_the_trainers_broadcast(tmp_path):
    """The trainer's side (hosted by `host_rendezvous` on a kernel-picked port, joined as rank 0, one broadcast
    per tensor: SGLang's format) and a process that joins and receives exactly as SGLang 0.5.x does
    (tests/helpers/sglang_standin.py), in update calls of a few tensors each. Twice, each time under the same group name
    at a new rendezvous, each side leaving the group in between: an engine joins again after a trainer restart."""
    g = torch.Generator().manual_seed(11)
    tensors = [torch.randn(4, 6, generator=g), torch.randn(9, generator=g).bfloat16(),
               torch.randn(3, 1, 5, generator=g).half(), torch.randn(700, generator=g), torch.randn(1, generator=g),
               torch.randn(33, 8, generator=g).bfloat16()]
    names = [f"layers.{i}.weight" for i in range(len(tensors))]
    specs = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in zip(names, tensors)]
    stores = [host_rendezvous("127.0.0.1", world_size=2, timeout_s=60) for _ in range(2)]
    out = tmp_path / "sglang.json"
    peer = subprocess.Popen([sys.executable, STANDIN, "peer", "--ports", ",".join(str(s.port) for s in stores),
                             "--group", "sglang_style", "--specs", json.dumps(specs), "--calls", "2,3,1",
                             "--default-group", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for store in stores:
            group = init_weight_update_group("127.0.0.1", store.port, 0, 2, "gloo", "sglang_style", timeout_s=60,
                                             store=store)
            assert broadcast_tensors(group, tensors, bucket_bytes=0) == sum(t.nbytes for t in tensors)
            group.destroy()
        log = peer.communicate(timeout=60)[0].decode()
    finally:
        if peer.poll() is None:
            peer.kill()
    assert peer.returncode == 0, log
    expected = [hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() for t in tensors]
    for received in json.loads(out.read_text()):
        assert received == {"names": names, "digests": expected}


def test_a_process_forms_a_group_again_and_can_hold_two_of_its_members():
    """torch registers a group under its name in a process: a further member of the group in the same process (a
    join while an earlier one was never destroyed; a test's engine and trainer) is registered under a name of its
    own but meets the others under the group's; destroy() frees the names, for the next join."""
    from torch.distributed import distributed_c10d

    first = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "gloo", "solo_group", timeout_s=10)
    second = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "gloo", "solo_group", timeout_s=10)
    first.barrier()
    second.barrier()
    first.destroy()
    second.destroy()
    third = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "gloo", "solo_group", timeout_s=10)
    assert distributed_c10d._world.pg_names[third.pg] == "solo_group"
    third.destroy()

    store = host_rendezvous("127.0.0.1", world_size=2, timeout_s=30)
    groups: dict = {}
    member = threading.Thread(target=lambda: groups.setdefault(1, init_weight_update_group(
        "127.0.0.1", store.port, 1, 2, "gloo", "pair_group", timeout_s=30)))
    member.start()
    groups[0] = init_weight_update_group("127.0.0.1", store.port, 0, 2, "gloo", "pair_group", timeout_s=30,
                                         store=store)
    member.join(timeout=30)
    assert sorted(n for n in distributed_c10d._world.pg_names.values() if n.startswith("pair_group")) == [
        "pair_group", "pair_group@1"]
    sent = torch.arange(6, dtype=torch.float32)
    receiving = threading.Thread(target=lambda: groups.setdefault("got", receive_tensors(
        groups[1], [TensorSpec("x", torch.float32, (6,))])))
    receiving.start()
    broadcast_tensors(groups[0], [sent])
    receiving.join(timeout=30)
    assert torch.equal(groups["got"][0], sent)
    groups[0].destroy()
    groups[1].destroy()
    left = {"solo_group", "solo_group@1", "pair_group", "pair_group@1"}
    assert not left & set(distributed_c10d._world.pg_names.values())

    # a torch group of that name that is not a weight-update group: refused, naming the config key
    foreign, _ = distributed_c10d._new_process_group_helper(1, 0, [], dist.Backend("gloo"), dist.HashStore(),
                                                            group_name="taken_group", timeout=timedelta(seconds=10))
    try:
        with pytest.raises(WeightSyncError, match="weight_sync.group_name"):
            init_weight_update_group("127.0.0.1", free_port(), 0, 1, "gloo", "taken_group", timeout_s=10)
    finally:
        distributed_c10d._world.pg_group_ranks[foreign] = {0: 0}
        dist.destroy_process_group(foreign)


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
    with pytest.raises(ValueError, match="backend"):
        init_weight_update_group("127.0.0.1", free_port(), 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank 2"):
        init_weight_update_group("127.0.0.1", free_port(), 2, 2)
