"""The embedded engine's spare weights, in process: updates received into wire-laid arenas (as gloo would
write them, padding included), switched in, and checked bit for bit against what was sent, through bucketed,
per-tensor and partial updates in a row. The same path over a real gloo group is tested in test_engine.py and
test_trainer.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipelinerl.engines.embedded.model_runner import make_runner
from pipelinerl.engines.embedded.spare_weights import SpareWeights
from pipelinerl.weight_sync import TensorSpec, plan_buckets, sibling_order, wire_buffers

CPU = torch.device("cpu")


@pytest.fixture()
def engine_side(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = make_runner(model, 2, 16)  # re-points q/k/v and gate/up to fused buffers, as the engine does
    params = dict(model.named_parameters(remove_duplicate=False))
    return model, runner, params, SpareWeights(params, runner.fused_groups)


def state_of(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in model.named_parameters()}


def receive(spare, state, bucket_bytes):
    """What the engine's receive thread does, with the broadcast simulated: each bucket's bytes (garbage in
    the padding) land in the flat buffer its targets share, then `after_bucket`; then the switch."""
    specs = [TensorSpec.of(n, t) for n, t in state.items()]
    plan = spare.staging(specs, bucket_bytes)
    sent = wire_buffers(specs, bucket_bytes)
    for t in sent:
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xA5)
    for t, src in zip(sent, state.values()):
        t.copy_(src)
    for bucket in plan_buckets(specs, bucket_bytes):
        first = bucket[0]
        if len(bucket) == 1:  # one tensor: received wherever its target is
            plan.targets[first].copy_(sent[first])
        else:  # one broadcast into the bucket's flat buffer: its targets must be views into it, nothing else
            flat = torch.empty(0, dtype=torch.uint8).set_(plan.targets[first].untyped_storage())
            flat.copy_(torch.empty(0, dtype=torch.uint8).set_(sent[first].untyped_storage()))
        plan.after_bucket(bucket)
    return plan, [s.name for s in specs]


def assert_live(params, runner, expected):
    for name, want in expected.items():
        assert torch.equal(params[name], want), name
    for buffer, members in runner.fused_groups:  # the runner computes with the fused buffers
        for param, start, end in members:
            assert torch.equal(buffer[start:end], param) and param.data_ptr() == buffer[start:end].data_ptr()


def test_updates_in_a_row_are_bit_exact_and_live_weights_untouched_until_the_switch(engine_side):
    model, runner, params, spare = engine_side
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = [(4096, None), (4096, None), (4096, None), (0, None), (4096, None), (1 << 20, None),
             (4096, ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                     "model.norm.weight"]),
             (4096, None)]
    for seed, (bucket_bytes, names) in enumerate(steps):
        new = state_of(model, seed)
        if names is not None:
            new = {n: new[n] for n in names}
        plan, received = receive(spare, new, bucket_bytes)
        assert_live(params, runner, expected)  # decoding goes on with the old weights meanwhile
        incoming = spare.incoming(received)
        spare.switch(received)
        expected.update(new)
        assert_live(params, runner, expected)
        # `incoming` told, before the switch, what each changed weight would become: the received tensor itself
        # (same memory), or None where only some rows of a fused buffer were updated (copied in place)
        live = {id(t): t for t in [*params.values(), *(buffer for buffer, _ in runner.fused_groups)]}
        partial = {id(buffer) for buffer, members in runner.fused_groups
                   if names is not None and any(p is params[n] for p, _, _ in members for n in names)}
        fused = {id(p) for _, members in runner.fused_groups for p, _, _ in members}
        whole_model = len({id(p) for p in params.values()} - fused) + len(runner.fused_groups)
        assert len(incoming) == (whole_model if names is None else 3)
        assert sorted(i for _, pieces in incoming.values() for i in pieces) == list(range(len(received)))
        for key, (tensor, _) in incoming.items():
            assert (tensor is None) == (key in partial)
            if tensor is not None:
                assert tensor.data_ptr() == live[key].data_ptr() and torch.equal(tensor, live[key])


def test_bucketed_update_lands_in_place_and_arenas_take_turns(engine_side):
    model, runner, params, spare = engine_side
    arenas = []
    for seed in range(4):
        plan, names = receive(spare, state_of(model, seed), 1 << 20)
        spare.switch(names)
        arenas.append(plan.targets[0].untyped_storage().data_ptr())
    assert arenas[0] == arenas[2] != arenas[1] == arenas[3]  # two arenas, reused: no allocation per update
    # Every parameter on its own, and the gate/up rows (back to back on the wire), now live in the arena;
    # only q/k/v, which the wire interleaves with their biases, were copied out of it.
    copied = {names[i] for i in plan.copies}
    assert copied and all(".self_attn.q_proj." in n or ".self_attn.k_proj." in n or ".self_attn.v_proj." in n
                          for n in copied)
    arena = {t.untyped_storage().data_ptr() for t in plan.targets}
    gate = model.model.layers[0].mlp.gate_proj.weight
    gate_up = [buf for buf, members in runner.fused_groups if members[0][0] is gate]
    assert gate_up and gate_up[0].untyped_storage().data_ptr() in arena
    assert params["model.layers.0.self_attn.o_proj.weight"].untyped_storage().data_ptr() in arena


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_in_sibling_order_nothing_is_copied(engine_side, bucket_bytes):
    """The trainer sends q/k/v weights back to back (`sibling_order`): every fused buffer is then one piece
    of a bucket, or (buckets too small to hold a projection and its sibling) received straight into its
    spare rows."""
    model, runner, params, spare = engine_side
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for seed in range(3):
        state = state_of(model, seed)
        names = list(state)
        state = {names[i]: state[names[i]] for i in sibling_order(names)}
        plan, received = receive(spare, state, bucket_bytes)
        assert not plan.copies
        spare.switch(received)
        expected.update(state)
        assert_live(params, runner, expected)


@pytest.mark.parametrize("bucket_bytes", [0, 4096, 1 << 20])
def test_weights_off_the_host_are_staged_and_switched_on_their_own_device(tiny_model_dir, bucket_bytes):
    """The GPU case, with the meta device standing in for the GPU: a gloo group receives through host memory,
    but the arenas and spares an update is staged in must lie where the weights do, or the switch would make a
    host tensor live in a GPU model (and a fused q/k/v buffer cannot point into host memory at all: the first
    bucketed update on a GPU raised there, and the trainer's broadcast then waited out its timeout)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to("meta")
    runner = make_runner(model, 2, 16)
    params = dict(model.named_parameters(remove_duplicate=False))
    spare = SpareWeights(params, runner.fused_groups)
    unique = dict(model.named_parameters())
    names = [list(unique)[i] for i in sibling_order(list(unique))]
    for _ in range(2):  # the second update reuses an arena or the spares
        plan = spare.staging([TensorSpec.of(n, unique[n]) for n in names], bucket_bytes)
        assert {t.device.type for t in plan.targets} == {"meta"}
        spare.switch(names)
        assert {p.device.type for p in params.values()} == {"meta"}
        assert {buffer.device.type for buffer, _ in runner.fused_groups} == {"meta"}
    # and a region received on another device is never made a piece of the weights' arena
    storage = spare._where[names[0]][0]
    elsewhere = {m: torch.empty(storage.live.shape if start is None else storage.live[start:end].shape)
                 for m, (_, start, end) in enumerate(storage.members)}
    assert storage.arena_region(elsewhere) is None
