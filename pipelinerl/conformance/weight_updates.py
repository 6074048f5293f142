"""The conformance checks of weight updates: joining the weight-update group, an update with the same weights,
one with new weights, one landing in the middle of a long generation, and refused ones. The suite acts as the
trainer (rank 0 of a gloo group) and checks outputs against the reference's rescoring under what it pushed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipelinerl.conformance.outcomes import CheckFailed, Skipped, error_of, expect, normalized_field
from pipelinerl.conformance.reference import mismatch
from pipelinerl.contracts.inference import Completion
from pipelinerl.engines.client import EngineError, init_group_on_engines, push_weights

if TYPE_CHECKING:
    from pipelinerl.conformance.runner import Suite


def check_group_init(suite: Suite) -> str:
    from pipelinerl.procs import free_port
    from pipelinerl.weight_sync import init_weight_update_group

    settings = suite.settings
    if suite.client.info().weight_group is None:
        r = suite.post("/v1/weights/update", {"version": suite.version + 1, "group_name": settings.group_name,
                                              "params": [{"name": "x", "dtype": "float32", "shape": [1]}]})
        expect(r.status_code == 409, f"an update before joining any group answered {r.status_code}, expected 409")
    port = free_port()
    world, futures = init_group_on_engines([suite.client], settings.master_address, port, "gloo",
                                           settings.group_name, settings.timeout_s)
    suite.group = init_weight_update_group(settings.master_address, port, 0, world, "gloo", settings.group_name,
                                           settings.timeout_s)
    for f in futures:
        f.result()
    group = suite.client.info().weight_group
    expect(group == settings.group_name, f"info.weight_group {group!r} after joining {settings.group_name!r}")
    r = suite.post("/v1/weights/update", {"version": suite.version + 1, "group_name": "not-" + settings.group_name,
                                          "params": [{"name": "x", "dtype": "float32", "shape": [1]}]})
    expect(r.status_code == 409 and normalized_field((error_of(r) or {}).get("field")) == "group_name",
           f"an update for a group the engine is not in answered {r.status_code}: {r.text[:200]}")
    return f"gloo group {settings.group_name!r}, world size {world}"


def check_update_identical(suite: Suite) -> str:
    suite.push(suite.ref.base)
    before = suite.greedy(24)
    sizes = sorted({suite.settings.bucket_bytes, 4096 if suite.settings.bucket_bytes == 0 else 0})
    for bb in sizes:
        resp = suite.push(suite.ref.base, bucket_bytes=bb)
        expect(resp.version == suite.version and resp.received_bytes > 0,
               f"update response {resp.model_dump()} for version {suite.version}")
        after = suite.greedy(24)
        expect(after.token_ids == before.token_ids,
               f"bucket_bytes={bb}: greedy output changed after an update with the same weights")
        expect(set(after.versions) == {suite.version},
               f"bucket_bytes={bb}: versions {sorted(set(after.versions))}, expected {suite.version}")
    return f"bucket_bytes {sizes}"


def _separating_weights(suite: Suite, seed: int) -> tuple[str, dict[str, torch.Tensor]]:
    """New weights (and what they are) under which the greedy first token after the prompt provably changes:
    no token within 2 x atol of the best one under the current weights is within 2 x atol of the best one
    under the new (by this model's rescoring), so no engine that passes the log-prob checks can give the same
    first token under both."""
    margin = 2 * suite.settings.atol
    old = torch.log_softmax(suite.ref.next_logits(suite.state, suite.prompt), -1)
    old_best = set(torch.nonzero(old >= old.max() - margin)[:, 0].tolist())
    for what, state in suite.ref.changed(seed):
        new = torch.log_softmax(suite.ref.next_logits(state, suite.prompt), -1)
        if not old_best & set(torch.nonzero(new >= new.max() - margin)[:, 0].tolist()):
            return what, state
    raise Skipped("no weights found that change the greedy first token of this model (its next-token "
                  f"log-probs after the prompt are flat within {margin:g})")


def check_update_changes(suite: Suite) -> str:
    before = suite.greedy(24)
    what, new = _separating_weights(suite, seed=1)
    resp = suite.push(new)
    expect(resp.version == suite.version, f"update answered version {resp.version}, sent {suite.version}")
    info = suite.client.info()
    expect(info.weight_version == suite.version, f"info.weight_version {info.weight_version} after the update "
                                                 f"to {suite.version}")
    c = suite.greedy(24)
    expect(c.token_ids != before.token_ids, "greedy output did not change after new weights")
    expect(set(c.versions) == {suite.version}, f"versions {sorted(set(c.versions))}, expected {suite.version}")
    problem = mismatch(c, suite.ref.logits(new, suite.prompt, c.token_ids), 0, suite.settings.atol)
    expect(problem is None, f"after the update: {problem}")
    sums = suite.checksums()
    if sums is None:
        return f"checksum route not implemented (501); outputs compared instead ({what})"
    from pipelinerl.engines.embedded.engine import tensor_checksums

    local = tensor_checksums(dict(suite.ref.named(new)))
    if not set(local) <= set(sums):
        return f"checksums use other parameter names than the model's; outputs compared instead ({what})"
    wrong = [n for n, h in local.items() if sums[n] != h]
    expect(not wrong, f"checksums differ from the pushed weights for {wrong[:3]}")
    return f"outputs and checksums match the pushed weights ({what})"


def check_in_flight_update(suite: Suite) -> str:
    if suite.state is not suite.ref.base:
        suite.push(suite.ref.base)
    old = suite.ref.base
    candidates = suite.ref.changed(seed=2)
    what, new = candidates.pop(0)
    steps, seconds = suite.long_run()
    delay = 0.35 * seconds
    landed: list[int] = []
    timing_tries = 5  # on a busy machine the timing of a generation varies: retry with another delay
    while timing_tries > 0:
        old_version = suite.version
        thread, result = suite.greedy_in_background(steps)
        time.sleep(delay)
        suite.push(new)
        thread.join(600)
        c = result.get("out")
        expect(isinstance(c, Completion), f"the long generation failed: {c!r}")
        expect(len(c.token_ids) == steps, f"{len(c.token_ids)} tokens, expected {steps}")
        new_version = suite.version
        switch = c.versions.index(new_version) if new_version in c.versions else steps
        landed.append(switch)
        if not 0 < switch < steps - 10:  # the update landed before or after the generation: time it again
            delay = delay * (2.0 if switch == 0 else 0.4)
            timing_tries -= 1
            suite.push(suite.ref.base)
            continue
        expect(c.versions == [old_version] * switch + [new_version] * (steps - switch),
               f"versions change more than once or to other values: {_runs(c.versions)}")
        problem = mismatch(c, suite.ref.logits_switched(old, new, suite.prompt, c.token_ids, switch), 0,
                           suite.settings.atol)
        expect(problem is None, f"switch at token {switch}: {problem} (expected: old weights before the switch, "
                                "new weights after it, attending to the KV cache computed before it)")
        suite.push(suite.ref.base)  # the original weights back after every try
        tail = Completion(token_ids=c.token_ids[switch:], logprobs=c.logprobs[switch:],
                          versions=c.versions[switch:], finish_reason=c.finish_reason)
        old_logits_after_switch = suite.ref.logits(old, suite.prompt, c.token_ids)[switch:]
        if mismatch(tail, old_logits_after_switch, 0, 2 * suite.settings.atol) is not None:
            return f"switched at token {switch} of {steps} (tries landed at {landed}; new weights: {what})"
        # The old weights give these tokens and log-probs too: this update cannot tell whether the engine
        # switched (an engine that kept the old weights would pass). Weights that change more, if any.
        if not candidates:
            raise Skipped(f"no weights found whose tokens after a switch differ from the old weights' (last: "
                          f"{what}): the model's next-token log-probs are flat")
        what, new = candidates.pop(0)
    raise CheckFailed(f"could not land an update inside a {steps}-token generation: tries landed at {landed}")


def check_refused_update(suite: Suite) -> str:
    if suite.state is not suite.ref.base:
        suite.push(suite.ref.base)
    sums_before = suite.checksums()
    before = suite.greedy(24)
    named = suite.ref.named(suite.ref.perturbed(seed=3))
    bad = min(3, len(named) - 1)
    name, t = named[bad]
    named[bad] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))
    cases = [(named, f"params[{bad}].shape", name),
             (suite.ref.named(suite.ref.base) + [("conformance.not_a_parameter", torch.zeros(2))],
              f"params[{len(named)}].name", "conformance.not_a_parameter"),
             ([(suite.ref.named(suite.ref.base)[0][0], suite.ref.named(suite.ref.base)[0][1].to(torch.float16))],
              "params[0].dtype", suite.ref.named(suite.ref.base)[0][0])]
    for tensors, want_field, want_name in cases:
        try:
            push_weights(suite.group, [suite.client], tensors, suite.version + 1, suite.settings.bucket_bytes)
        except EngineError as e:
            expect(e.status == 400, f"mismatched update ({want_field}) answered {e.status}, expected 400")
            expect(normalized_field(e.field) == normalized_field(want_field),
                   f"mismatched update: error.field {e.field!r}, expected {want_field!r}")
            expect(want_name in e.message, f"the refusal does not name {want_name!r}: {e.message}")
        else:
            raise CheckFailed(f"a mismatched update ({want_field}) was accepted")
    if sums_before is not None:
        expect(suite.checksums() == sums_before, "checksums changed after refused updates")
    after = suite.greedy(24)
    expect(after.token_ids == before.token_ids and
           max((abs(x - y) for x, y in zip(after.logprobs, before.logprobs)), default=0.0) < 1e-4,
           "greedy output or log-probs changed after refused updates")
    resp = suite.push(suite.ref.base)
    expect(resp.version == suite.version, "a valid update after refused ones failed")
    return "weights unchanged (" + ("checksums" if sums_before is not None else "identical greedy output") + ")"


def _runs(versions: Sequence[int]) -> str:
    """Versions as runs, e.g. "3x120, 4x80", for a message short enough to read."""
    out, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            out.append(f"{versions[start]}x{i - start}")
            start = i
    return ", ".join(out)
