"""The embedded engine as a real server process on loopback, with this test process as the trainer (rank 0 of
a real gloo weight-update group)."""

import asyncio
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import running_engine, wait_until
from transformers import AutoModelForCausalLM

from pipelinerl.contracts.inference import (
    GenerateRequest,
    InitWeightUpdateGroupRequest,
    SamplingParams,
    UpdateWeightsRequest,
)
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.client import EngineError, init_group_on_engines, param_specs, push_weights
from pipelinerl.engines.embedded.engine import EmbeddedEngine, EngineSettings, tensor_checksums
from pipelinerl.engines.embedded.packed import PackedLayout
from pipelinerl.procs import free_port
from pipelinerl.weight_sync import broadcast_tensors, init_weight_update_group

PROMPT = [5, 6, 67, 7, 8, 71]


def greedy_tokens(model, state, prompt, steps, margins=None):
    """`steps` greedy tokens after `prompt` from transformers' `model` loaded with `state`; `margins` (a list)
    gets the gap between the two highest logits at each step."""
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
        out = model(torch.tensor([list(prompt)]), use_cache=True)
        return _greedy_steps(model, out.past_key_values, out.logits[0, -1], steps, margins)


def _greedy_steps(model, cache, logits, steps, margins=None):
    tokens = []
    for _ in range(steps):
        if margins is not None:
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
        t = int(logits.argmax())
        tokens.append(t)
        out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
    return tokens


# Two float32 implementations of one model (transformers here, the engine's own kernels there) differ in the
# last bits of the logits. Over a thousand greedy steps the reference's two best tokens come that close now and
# then (gaps of 1e-5 were seen), and either may be picked: a long greedy output may part from the reference only
# at such a near tie.
NEAR_TIE = 1e-3


def assert_greedy_follows(got: list[int], want: list[int], margins: list[float], what: str) -> bool:
    """`got` equals the reference `want`, or parts from it at a near tie (then nothing after can be compared:
    returns False)."""
    assert len(got) == len(want), what
    diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diverged is None:
        return True
    assert margins[diverged] < NEAR_TIE, (f"{what}: token {diverged} is {got[diverged]}, the reference's is "
                                          f"{want[diverged]}, which it preferred by {margins[diverged]:.2e}")
    return False


class Trainer:
    """The trainer side: holds reference weights and pushes them to the engine."""

    def __init__(self, client, model_dir):
        self.client = client
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # parameters only, deduplicated: a tied lm_head follows the embedding, as on the engine
        self.base = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        port = free_port()
        world, futures = init_group_on_engines([client], "127.0.0.1", port, "gloo", "weight_update", 30)
        self.group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", timeout_s=30)
        for f in futures:
            f.result()
        self.version = 0

    def named(self, state):
        return [(n, state[n]) for n, _ in self.model.named_parameters()]

    def push(self, state, bucket_bytes=0, only=None):
        """Send `state` as the next version; `only` (names): a partial update of just those parameters."""
        self.version += 1
        named = [(n, t) for n, t in self.named(state) if only is None or n in only]
        return push_weights(self.group, [self.client], named, self.version, bucket_bytes)[0]

    def perturbed(self, seed, scale=0.5):
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
                for k, v in self.base.items()}

    def greedy_reference(self, state, prompt, steps, margins=None):
        """Greedy tokens under `state` (see greedy_tokens)."""
        return greedy_tokens(self.model, state, prompt, steps, margins)

    def continue_after_switch(self, old_state, new_state, prompt, old_tokens, steps, margins=None):
        """Tokens after a switch: the cache holds prompt + old_tokens[:-1] under old weights; the new weights
        consume old_tokens[-1] and go on greedily."""
        with torch.no_grad():
            self.model.load_state_dict(old_state, strict=False)
            out = self.model(torch.tensor([list(prompt) + old_tokens[:-1]]), use_cache=True)
            self.model.load_state_dict(new_state, strict=False)
            out = self.model(torch.tensor([[old_tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            return _greedy_steps(self.model, out.past_key_values, out.logits[0, -1], steps, margins)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    with running_engine(tiny_model_dir, log_dir, extra=["--max-model-len", "1100", "--max-running-seqs", "8",
                                                        "--max-batch-tokens", "8800"]) as client:
        yield client


@pytest.fixture(scope="module")
def trainer(engine, tiny_model_dir):
    t = Trainer(engine, tiny_model_dir)
    yield t
    t.group.destroy()


def test_greedy_matches_transformers_and_logprobs_rescore(engine, trainer):
    trainer.push(trainer.base)
    out = engine.generate(PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True).completions[0]
    assert out.token_ids == trainer.greedy_reference(trainer.base, PROMPT, 24)
    with torch.no_grad():
        trainer.model.load_state_dict(trainer.base, strict=False)
        logits = trainer.model(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_sampled_logprobs_are_temperature_scaled_and_seeded_sampling_repeats(engine, trainer):
    trainer.push(trainer.base)
    a = engine.generate(PROMPT, temperature=0.7, max_new_tokens=16, seed=11, n=3, ignore_eos=True)
    b = engine.generate(PROMPT, temperature=0.7, max_new_tokens=16, seed=11, n=3, ignore_eos=True)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert len({tuple(c.token_ids) for c in a.completions}) > 1, "n samples of one prompt should differ"
    c = a.completions[0]
    with torch.no_grad():
        logits = trainer.model(torch.tensor([PROMPT + c.token_ids])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize("bucket_bytes", [0, 4096])
def test_update_with_identical_weights_keeps_greedy_output(engine, trainer, bucket_bytes):
    trainer.push(trainer.base)
    before = engine.generate(PROMPT, temperature=0, max_new_tokens=32, ignore_eos=True).completions[0]
    resp = trainer.push(trainer.base, bucket_bytes=bucket_bytes)
    assert resp.version == trainer.version and resp.received_bytes > 0
    after = engine.generate(PROMPT, temperature=0, max_new_tokens=32, ignore_eos=True).completions[0]
    assert after.token_ids == before.token_ids
    assert set(after.versions) == {trainer.version}


def test_update_changes_outputs_and_checksums_match_trainer(engine, trainer):
    new = trainer.perturbed(seed=1)
    trainer.push(new)
    remote = httpx.get(f"{engine.url}/v1/weights/checksum").json()
    local = tensor_checksums(dict(trainer.named(new)))
    assert remote["version"] == trainer.version
    assert all(remote["checksums"][n] == h for n, h in local.items())
    out = engine.generate(PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True).completions[0]
    assert out.token_ids == trainer.greedy_reference(new, PROMPT, 24)


def switch_point(out, version) -> int:
    """The index of the first token of `out` labelled `version` (its length if none is)."""
    return out.versions.index(version) if version in out.versions else len(out.token_ids)


def assert_switched_in_flight(trainer, out, old, new, old_version) -> None:
    """`out` (a greedy completion of PROMPT) switched from `old` to `new` (the trainer's current version) at a
    step boundary: the tokens before are old's, the ones after continue from the same KV cache under new."""
    steps, switch = len(out.token_ids), switch_point(out, trainer.version)
    assert out.versions == [old_version] * switch + [trainer.version] * (steps - switch)
    margins: list[float] = []
    before = trainer.greedy_reference(old, PROMPT, switch, margins)
    if assert_greedy_follows(out.token_ids[:switch], before, margins, "before the switch"):
        margins = []
        after = trainer.continue_after_switch(old, new, PROMPT, out.token_ids[:switch], steps - switch, margins)
        assert_greedy_follows(out.token_ids[switch:], after, margins, "after the switch")


def test_in_flight_switch_continues_from_kv_cache(engine, trainer):
    old, new = trainer.base, trainer.perturbed(seed=2)
    steps = 1000
    # Whether the push lands inside the generation is up to timing (a stalled test process could miss the
    # ~1 s window): try a few times before calling it a failure.
    for _ in range(5):
        trainer.push(old)
        old_version = trainer.version
        result = {}
        thread = threading.Thread(target=lambda result=result: result.update(
            out=engine.generate(PROMPT, temperature=0, max_new_tokens=steps, ignore_eos=True)))
        thread.start()
        start_tokens = engine.metrics()["pipelinerl_generated_tokens_total"]
        wait_until(lambda start=start_tokens: engine.metrics()["pipelinerl_generated_tokens_total"] >= start + 50,
                   "50 tokens generated", poll_s=0.02)
        trainer.push(new)
        thread.join(timeout=60)
        out = result["out"].completions[0]
        assert len(out.token_ids) == steps
        if 0 < switch_point(out, trainer.version) < steps - 10:
            break
    else:
        pytest.fail("in 5 tries, the update never landed in the middle of the generation")
    assert_switched_in_flight(trainer, out, old, new, old_version)
    # and it differs from simply running the new model from scratch, so the cache really was kept
    assert engine.metrics()["pipelinerl_weight_updates_while_running_total"] >= 1


def test_concurrent_requests_during_update_stream(engine, trainer):
    trainer.push(trainer.base)
    first = trainer.version
    n_updates = 5

    def one(i):
        return engine.generate(PROMPT[: 2 + i % 4], temperature=1.0, max_new_tokens=600 + 20 * i, n=2,
                               ignore_eos=True, seed=i)

    # made before generation starts, and generations long enough (~17k tokens, 3 waves of 8 sequences) that five
    # pushes land inside them even when each push is slow on a loaded machine
    updates = [trainer.perturbed(seed=100 + k, scale=0.05) for k in range(n_updates)]
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        # the updates land while sequences run: each after the engine has decoded more tokens since the last (a
        # fixed sleep let all five land before the first token on a loaded machine: every token had the last version)
        wait_until(lambda: engine.metrics()["pipelinerl_running_seqs"] > 0, "a sequence running")
        for k in range(n_updates):
            start = engine.metrics()["pipelinerl_generated_tokens_total"]
            wait_until(lambda start=start: engine.metrics()["pipelinerl_generated_tokens_total"] >= start + 30,
                       "30 more tokens decoded", poll_s=0.01)
            trainer.push(updates[k])
        results = [f.result(timeout=120) for f in futures]
    seen = set()
    for r in results:
        for c in r.completions:
            assert c.finish_reason == "length"
            assert all(a <= b for a, b in zip(c.versions, c.versions[1:])), "versions must not go back"
            assert first <= c.versions[0] and c.versions[-1] <= trainer.version
            seen.update(c.versions)
    assert len(seen) > 1, "some sequences should span an update"
    assert engine.info().weight_version == trainer.version


def test_mismatched_update_is_refused_and_weights_untouched(engine, trainer):
    trainer.push(trainer.base)
    before = httpx.get(f"{engine.url}/v1/weights/checksum").json()
    named = trainer.named(trainer.perturbed(seed=3))
    bad_index = 3
    name, t = named[bad_index]
    named[bad_index] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))
    with pytest.raises(EngineError) as err:
        push_weights(trainer.group, [engine], named, trainer.version + 1)
    assert err.value.status == 400 and name in err.value.message and "shape" in err.value.message
    after = httpx.get(f"{engine.url}/v1/weights/checksum").json()
    assert after == before
    # unknown name and wrong dtype are refused too, and the group still works afterwards
    named = trainer.named(trainer.base)
    with pytest.raises(EngineError, match="not a parameter"):
        push_weights(trainer.group, [engine], named + [("nope.weight", torch.zeros(2))], trainer.version + 1)
    with pytest.raises(EngineError, match="bfloat16"):
        push_weights(trainer.group, [engine], [(named[0][0], named[0][1].bfloat16())], trainer.version + 1)
    assert httpx.get(f"{engine.url}/v1/weights/checksum").json() == before
    assert engine.metrics()["pipelinerl_weight_updates_refused_total"] >= 3
    trainer.push(trainer.base)


def test_abort_one_and_all(engine):
    # The three requests must still be running when the aborts arrive: a stalled test process could let one
    # finish its 1000 tokens first, so a try where one did is run again.
    for _ in range(3):
        result = {}

        def run(key, result=result):
            result[key] = engine.generate(PROMPT, temperature=0, max_new_tokens=1000, ignore_eos=True,
                                          request_id=key)

        threads = [threading.Thread(target=run, args=(k,)) for k in ("a", "b", "c")]
        for t in threads:
            t.start()
        wait_until(lambda: engine.metrics()["pipelinerl_running_seqs"] >= 3, "three sequences running")
        aborted_one = engine.abort("a")
        threads[0].join(30)
        aborted_rest = sorted(engine.abort())
        for t in threads[1:]:
            t.join(30)
        finishes = {k: result[k].completions[0].finish_reason for k in ("a", "b", "c")}
        if "length" not in finishes.values():
            break
        # one finished before its abort: then the abort must not have claimed it
        assert all(k not in aborted_one + aborted_rest for k, f in finishes.items() if f == "length")
    assert aborted_one == ["a"]
    a = result["a"].completions[0]
    assert a.finish_reason == "abort" and 0 < len(a.token_ids) < 1000
    assert len(a.logprobs) == len(a.versions) == len(a.token_ids)
    assert aborted_rest == ["b", "c"]
    assert finishes == {"a": "abort", "b": "abort", "c": "abort"}
    assert engine.abort("missing") == []


def test_queueing_beyond_running_limit(engine):
    # 8 running sequences at most: 20 requests of n=2 queue and all finish
    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(lambda i: engine.generate([5 + i % 10, 6], temperature=0.5, max_new_tokens=20,
                                                       n=2, ignore_eos=True), range(20)))
    assert all(len(c.token_ids) == 20 for o in outs for c in o.completions)


def test_stop_tokens_and_length(engine, trainer):
    trainer.push(trainer.base)
    greedy = engine.generate(PROMPT, temperature=0, max_new_tokens=10, ignore_eos=True).completions[0]
    stop_at = greedy.token_ids[3]
    out = engine.generate(PROMPT, temperature=0, max_new_tokens=10, ignore_eos=True,
                          stop_token_ids=[stop_at]).completions[0]
    k = greedy.token_ids.index(stop_at)
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: k + 1]
    long_prompt = [5] * 1090
    out = engine.generate(long_prompt, temperature=0, max_new_tokens=500, ignore_eos=True).completions[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1100 - 1090


@pytest.mark.parametrize("body, field", [
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 1100}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, 100000]}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": [5, -1]}, "prompt_token_ids.1"),
    ({"prompt_token_ids": [5], "sampling": {"temperature": -0.5}}, "sampling.temperature"),
    ({"prompt_token_ids": [5], "sampling": {"top_p": 0}}, "sampling.top_p"),
    ({"prompt_token_ids": [5], "sampling": {"top_k": -3}}, "sampling.top_k"),
    ({"prompt_token_ids": [5], "sampling": {"max_new_tokens": 10**9}}, "sampling.max_new_tokens"),
    ({"prompt_token_ids": [5], "sampling": {"n": 0}}, "sampling.n"),
    ({"prompt_token_ids": [5], "sampling": {"n": 100}}, "sampling.n"),
    ({"prompt_token_ids": [5], "sampling": {"stop_token_ids": [10**6]}}, "sampling.stop_token_ids[0]"),
    ({"prompt_token_ids": [5], "sampling": {"stop": [""]}}, "sampling.stop.0"),
    ({"prompt_token_ids": [5], "sampling": {"stop": ["x" * 257]}}, "sampling.stop.0"),
    ({"prompt_token_ids": [5], "sampling": {"stop": ["x"] * 17}}, "sampling.stop"),
    ({"prompt_token_ids": [5], "sampling": {"stop": "</answer>"}}, "sampling.stop"),
    ({"prompt_token_ids": [5], "sampling": {"temprature": 1}}, "sampling.temprature"),
    ({"prompt_token_ids": "hello"}, "prompt_token_ids"),
    ({"prompt_token_ids": [5], "extra": True}, "extra"),
])
def test_bad_generate_input_is_a_4xx_naming_the_field(engine, body, field):
    r = httpx.post(f"{engine.url}/v1/generate", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    assert err["message"]


def test_bad_input_leaves_server_serving(engine):
    assert httpx.post(f"{engine.url}/v1/generate", content=b"{not json").status_code == 400
    r = httpx.post(f"{engine.url}/v1/weights/update", json={"version": 1, "params": []})
    assert r.status_code == 400 and r.json()["error"]["field"] == "params"
    out = engine.generate([5, 6], temperature=0, max_new_tokens=4, ignore_eos=True)
    assert len(out.completions[0].token_ids) == 4


def test_openai_completions(engine):
    r = httpx.post(f"{engine.url}/v1/completions",
                   json={"prompt": ["1+1=", "2+2="], "max_tokens": 5, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] <= 10
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(body["choices"][0]["logprobs"]["tokens"])


def test_info_and_metrics(engine, trainer):  # trainer: the engine has joined its weight-update group
    info = engine.info()
    assert info.engine == "embedded" and info.vocab_size == 100 and info.max_model_len == 1100
    assert info.weight_group == "weight_update"
    m = engine.metrics()
    for key in ("pipelinerl_running_seqs", "pipelinerl_waiting_requests", "pipelinerl_tokens_per_second",
                "pipelinerl_weight_updates_total", "pipelinerl_weight_update_bytes_total",
                "pipelinerl_weight_update_switch_seconds_total"):
        assert key in m
    assert m["pipelinerl_generated_tokens_total"] > 0


def test_burst_of_requests_is_admitted_as_one_prefill(tiny_model_dir):
    """Requests submitted together (one asyncio.gather) reach the engine thread together: one admission, one
    batched prefill, every sequence in step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(model, str(tiny_model_dir), EngineSettings(max_running_seqs=16, max_model_len=64))
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)

    async def burst(k):
        return await asyncio.gather(*(engine.generate(GenerateRequest(prompt_token_ids=[5 + i, 6, 7], sampling=params))
                                      for i in range(k)))

    try:
        loop = asyncio.new_event_loop()
        for k in (12, 3, 16):
            before = (engine.metrics.admissions, engine.metrics.decode_steps)
            responses = loop.run_until_complete(burst(k))
            assert [len(r.completions[0].token_ids) for r in responses] == [5] * k
            assert engine.metrics.admissions - before[0] == 1, f"a burst of {k} was admitted in several waves"
            assert engine.metrics.decode_steps - before[1] == 4  # the first token comes from the prefill
        loop.close()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transposed, receiver", [("all", "process"), ("none", "process"), ("all", "thread"),
                                                   ("packed", "process"), ("packed", "thread")])
def test_transposed_weight_copies_follow_every_update(tiny_model_dir, tmp_path, transposed, receiver):
    """With `--transposed-weights all` the engine multiplies by transposed copies of every weight (what it does
    on CPU wherever that was timed faster); with `packed`, by copies packed in oneDNN's layout (packed.py), which
    the receiving process writes in shared memory and the engine multiplies through views of. With sequences
    decoding, an update's copies are built from the received weights before the switch (by the receiving
    process, or thread), so they are in use when the update call returns; with none, the switch does not wait
    for them: they are built after it and taken into use once ready. Greedy output follows the pushed weights
    either way; with `none` nothing is copied."""
    if transposed == "packed" and PackedLayout.of(128, 64) is None:
        pytest.skip("oneDNN on this CPU (or torch) wants another layout than packed.py's panels: no packed copies")
    copying = transposed != "none"
    extra = ["--transposed-weights", transposed, "--update-receiver", receiver, "--log-level", "info"]
    with running_engine(tiny_model_dir, tmp_path, extra=extra) as client:
        if transposed == "packed":  # the engine says how it multiplies each weight shape
            assert "'64x256': 'packed copy; packed onednn for 1+ rows'" in client.log_path.read_text()
        trainer = Trainer(client, tiny_model_dir)

        def relayouts():
            return client.metrics()["pipelinerl_weight_relayouts_total"]

        try:
            for updates, seed in enumerate((5, 6), start=1):  # idle: copies after the switch
                state = trainer.perturbed(seed=seed)
                trainer.push(state)
                if copying:
                    wait_until(lambda n=updates: relayouts() == n, f"copies of update {updates} taken into use")
                out = client.generate(PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True).completions[0]
                assert out.token_ids == trainer.greedy_reference(state, PROMPT, 24)

            # decoding: copies before the switch, the generation going on from its KV cache under them
            old, state, steps = state, trainer.perturbed(seed=7), 1000
            for _ in range(5):  # whether the push lands inside the generation is up to timing
                before = relayouts()
                trainer.push(old)
                old_version = trainer.version
                if copying:
                    wait_until(lambda n=before + 1: relayouts() == n, "copies taken into use")
                with ThreadPoolExecutor(1) as pool:
                    running = pool.submit(client.generate, PROMPT, temperature=0, max_new_tokens=steps,
                                          ignore_eos=True)
                    # or already finished: on a loaded machine the poll can miss the whole generation; the
                    # push then lands on an idle engine, which the checks below take as such
                    wait_until(lambda r=running: r.done() or client.metrics()["pipelinerl_running_seqs"] > 0,
                               "a sequence running", poll_s=0.01)
                    trainer.push(state)
                    at_return = relayouts()
                    out = running.result(timeout=60).completions[0]
                if not copying:
                    assert at_return == 0
                elif switch_point(out, trainer.version) < len(out.token_ids):
                    # the update switched mid-generation, so the engine was decoding when it arrived: its copies
                    # were built before the switch and in use as the update returned
                    assert at_return == before + 2
                else:  # the generation ended first (a loaded machine): idle, copies after the switch
                    wait_until(lambda n=before + 2: relayouts() == n, "copies taken into use")
                if 0 < switch_point(out, trainer.version) < len(out.token_ids) - 10:
                    break
            else:
                pytest.fail("in 5 tries, the update never landed in the middle of the generation")
            assert_switched_in_flight(trainer, out, old, state, old_version)
            assert (client.metrics()["pipelinerl_weight_relayout_seconds_total"] > 0) == copying

            # A partial update of rows of the fused q/k/v weights: changed in place at the switch, their copies
            # are rebuilt there
            only = {n for n in state if "q_proj.weight" in n}
            state = {**state, **{n: t for n, t in trainer.perturbed(seed=8).items() if n in only}}
            trainer.push(state, only=only)
            out = client.generate(PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True).completions[0]
            assert out.token_ids == trainer.greedy_reference(state, PROMPT, 24)
            m = client.metrics()
            assert (m["pipelinerl_weight_relayout_seconds_total"] > 0) == copying
        finally:
            trainer.group.destroy()


def test_idle_switch_uses_live_weights_until_copies_are_built(tiny_model_dir):
    """In process, with the building of transposed copies held back: an update that arrives while nothing is
    decoding switches at once; until its copies are ready the engine multiplies by the live weights (the old
    copies would give the old model's tokens), then takes the copies into use."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(model, str(tiny_model_dir),
                            EngineSettings(max_running_seqs=4, max_model_len=64, transposed_weights="all"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    new = {n: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=g) if p.dim() > 1
           else p.detach().clone() for n, p in reference.named_parameters()}
    release = threading.Event()
    build = engine.runner.build_copies
    engine.runner.build_copies = lambda sources: release.wait(30) and build(sources)
    loop = asyncio.new_event_loop()
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

    def generate() -> list[int]:
        request = GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy)
        return loop.run_until_complete(engine.generate(request)).completions[0].token_ids

    try:
        port = free_port()
        with ThreadPoolExecutor(1) as pool:  # the engine joins the group as rank 1 while this thread is rank 0
            joined = pool.submit(loop.run_until_complete, engine.init_weight_update_group(
                InitWeightUpdateGroupRequest(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                             world_size=2, backend="gloo", timeout_s=30)))
            group = init_weight_update_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
            joined.result()
            old_tokens = generate()
            named = list(new.items())
            update = pool.submit(loop.run_until_complete, engine.update_weights(
                UpdateWeightsRequest(version=1, params=param_specs(named))))
            broadcast_tensors(group, [t for _, t in named])
            assert update.result(timeout=30).version == 1
        expected = greedy_tokens(reference, new, PROMPT, 12)
        assert expected != old_tokens and engine.metrics.relayouts == 0
        assert generate() == expected  # the copies are held back: the live weights
        release.set()
        wait_until(lambda: engine.metrics.relayouts == 1, "copies taken into use")
        assert not engine.runner.layers[0].qkv_w.is_contiguous()  # a transposed copy
        assert generate() == expected
    finally:
        release.set()
        engine.shutdown()
        loop.close()


@pytest.mark.parametrize("receiver", ["thread", "process"])
def test_each_receiver_refuses_a_mismatched_update_and_takes_the_next(tiny_model_dir, receiver):
    """In process, with each update receiver: a mismatched update is drained (the trainer's broadcast ends) and
    refused with the field and the reason, the weights untouched; the next update, naming the tied output
    embedding by its own name, lands in the one tensor both names share."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(model, str(tiny_model_dir),
                            EngineSettings(max_running_seqs=2, max_model_len=64, update_receiver=receiver))
    assert engine.receive_in_process == (receiver == "process")
    loop = asyncio.new_event_loop()
    group = None

    def update(pool, named, version):
        done = pool.submit(loop.run_until_complete, engine.update_weights(
            UpdateWeightsRequest(version=version, params=param_specs(named), bucket_bytes=4096)))
        broadcast_tensors(group, [t for _, t in named], 4096)
        return done.result(timeout=30)

    try:
        port = free_port()
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(loop.run_until_complete, engine.init_weight_update_group(
                InitWeightUpdateGroupRequest(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                             world_size=2, backend="gloo", timeout_s=30)))
            group = init_weight_update_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
            joined.result()
            assert engine.info().weight_group == "weight_update"
            before = tensor_checksums(engine.params)
            embedding = engine.params["model.embed_tokens.weight"]
            bad = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.zeros(3, 64))]
            with pytest.raises(ContractError) as refused:
                update(pool, bad, 1)
            assert (refused.value.status, refused.value.field) == (400, "params[1].shape")
            assert refused.value.message == ("params[1]: 'lm_head.weight' has shape [100, 64] in the model, the "
                                             "update says [3, 64]")
            assert tensor_checksums(engine.params) == before and engine.metrics.refused_updates == 1
            new = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(5))
            assert update(pool, [("lm_head.weight", new)], 2).version == 2
        assert torch.equal(engine.params["model.embed_tokens.weight"], new)
        assert engine.params["lm_head.weight"] is engine.params["model.embed_tokens.weight"]
        assert engine.version == 2 and engine.metrics.updates == 1
    finally:
        engine.shutdown()
        loop.close()
        if group is not None:
            group.destroy()


def receiver_pid(server_pid: int) -> int:
    """The pid of the engine's weight-receiving process: its child started by multiprocessing's spawn."""
    children = set()
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children |= {int(pid) for pid in (task / "children").read_text().split()}
    spawned = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(spawned) == 1, f"expected one receiving process among the engine's children {sorted(children)}"
    return spawned[0]


def test_a_dead_weight_receiver_is_replaced_and_counted(tiny_model_dir, tmp_path):
    """The receiving process is killed: the next update fails with an error that says to rejoin, the engine
    serves on with its weights untouched, starts another receiver (counted in /metrics), and after the trainer
    forms the group again, updates land as before."""
    with running_engine(tiny_model_dir, tmp_path, extra=["--transposed-weights", "all"]) as client:
        trainer = Trainer(client, tiny_model_dir)
        try:
            state = trainer.perturbed(seed=11)
            trainer.push(state)
            checksums = httpx.get(f"{client.url}/v1/weights/checksum").json()["checksums"]
            dead = receiver_pid(client.process.pid)
            os.kill(dead, signal.SIGKILL)
            with pytest.raises((EngineError, RuntimeError)):  # the broadcast fails, or the engine answers 500
                trainer.push(trainer.perturbed(seed=12))
            wait_until(lambda: client.metrics()["pipelinerl_weight_receiver_restarts_total"] == 1,
                       "the dead receiver counted")
            assert httpx.get(f"{client.url}/v1/weights/checksum").json()["checksums"] == checksums
            assert client.info().weight_group is None  # the group went with the dead receiver
            out = client.generate(PROMPT, temperature=0, max_new_tokens=16, ignore_eos=True).completions[0]
            assert out.token_ids == trainer.greedy_reference(state, PROMPT, 16)
        finally:
            trainer.group.destroy()
        trainer = Trainer(client, tiny_model_dir)  # joins again
        try:
            assert receiver_pid(client.process.pid) != dead
            state = trainer.perturbed(seed=13)
            trainer.push(state, bucket_bytes=4096)
            out = client.generate(PROMPT, temperature=0, max_new_tokens=16, ignore_eos=True).completions[0]
            assert out.token_ids == trainer.greedy_reference(state, PROMPT, 16)
        finally:
            trainer.group.destroy()


def test_too_little_shared_memory_is_named_before_it_is_used(tmp_path):
    """Receiving in a process needs the weights in shared memory; where its directory has too little room, the
    engine says so (how much it needs, how much there is, what to do) instead of dying of SIGBUS mid-update."""
    from pipelinerl.engines.embedded.receiving_process import shared_memory_shortfall

    assert shared_memory_shortfall(1 << 20, directory=str(tmp_path)) is None
    message = shared_memory_shortfall(1 << 60, directory=str(tmp_path))
    assert message is not None and str(tmp_path) in message and "--shm-size" in message
    assert shared_memory_shortfall(1 << 60, directory=str(tmp_path / "absent")) is None
    # the copies of the weights count: a weight with packed and transposed copies needs room for both
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    assert shared_memory_shortfall(free // 6, 0, directory=str(tmp_path)) is None
    assert shared_memory_shortfall(free // 6, free, directory=str(tmp_path)) is not None
