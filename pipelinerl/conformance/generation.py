"""The conformance checks that leave the weights alone: the health, info and metrics routes, generation's fields
and log-probs (against the reference's rescoring), stop tokens, stop strings and length, queueing beyond the
running limit, `/v1/completions`, bad input, and abort. Each is a function of the `Suite` that runs it."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx

from pipelinerl.conformance.outcomes import CheckFailed, Skipped, error_of, expect, normalized_field
from pipelinerl.conformance.reference import mismatch
from pipelinerl.contracts.inference import CONTRACT_VERSION, Completion
from pipelinerl.engines.client import EngineError

if TYPE_CHECKING:
    from pipelinerl.conformance.runner import Suite


def check_health_info(suite: Suite) -> str:
    r = httpx.get(f"{suite.url}/v1/health", timeout=10)
    expect(r.status_code == 200 and r.json().get("status") == "ok", f"/v1/health: {r.status_code} {r.text}")
    theirs = r.json().get("contract_version", "")
    expect(theirs.split(".")[0] == CONTRACT_VERSION.split(".")[0],
           f"contract version {theirs!r}, this suite checks {CONTRACT_VERSION}")
    info = suite.info
    expect(info.vocab_size == suite.ref.vocab_size,
           f"info.vocab_size {info.vocab_size}, the local model has {suite.ref.vocab_size}")
    expect(info.max_model_len > len(suite.prompt) + 8, f"info.max_model_len {info.max_model_len} is too small")
    expect(info.max_running_seqs >= 1, "info.max_running_seqs must be at least 1")
    m = httpx.get(f"{suite.url}/metrics", timeout=10, headers=suite.auth)
    expect(m.status_code == 200 and "pipelinerl_weight_version" in m.text,
           "/metrics must be Prometheus text with pipelinerl_weight_version")
    suite.version = info.weight_version
    return f"engine {info.engine!r}, weight version {info.weight_version}, max_model_len {info.max_model_len}"


def check_generate_fields(suite: Suite) -> str:
    rid = f"conformance-{uuid.uuid4().hex[:8]}"
    out = suite.client.generate(suite.prompt, request_id=rid, temperature=0, max_new_tokens=8, ignore_eos=True)
    expect(out.request_id == rid, f"request_id {out.request_id!r}, sent {rid!r}")
    expect(out.prompt_len == len(suite.prompt), f"prompt_len {out.prompt_len}, prompt has {len(suite.prompt)}")
    expect(len(out.completions) == 1, f"{len(out.completions)} completions for n=1")
    c = out.completions[0]
    expect(len(c.token_ids) == 8 and len(c.logprobs) == 8 and len(c.versions) == 8,
           f"lengths token_ids/logprobs/versions {len(c.token_ids)}/{len(c.logprobs)}/{len(c.versions)}, "
           "expected 8 each")
    expect(c.finish_reason == "length", f"finish_reason {c.finish_reason!r} at max_new_tokens, expected length")
    expect(set(c.versions) == {suite.version}, f"versions {sorted(set(c.versions))}, weights are {suite.version}")
    expect(all(lp <= 1e-6 for lp in c.logprobs), "log-probs must be <= 0")
    n = min(3, suite.info.max_running_seqs)  # more samples than the running limit are refused (bad_input)
    temperature, p_same = suite._spread_temperature(n)
    kw = dict(temperature=temperature, max_new_tokens=8, ignore_eos=True, n=n, seed=11)
    a = suite.client.generate(suite.prompt, **kw).completions
    b = suite.client.generate(suite.prompt, **kw).completions
    expect(len(a) == n, f"{len(a)} completions for n={n}")
    expect([x.token_ids for x in a] == [x.token_ids for x in b], "the same seed gave different samples")
    # n independent samples are all identical with probability at most p_same (their first tokens are, by
    # the rescoring's distribution), so requests with other seeds are drawn until a correct engine fails with
    # probability below 1e-9; an engine that copies one sample n times fails every time.
    if n < 2 or p_same > 0.5:
        return (f"samples not compared: n={n}, and at temperature {temperature:g} the samples' first tokens "
                f"all agree with probability {p_same:.3g} (a confident model)")
    requests = max(1, math.ceil(math.log(1e-9) / math.log(max(p_same, 1e-300))))
    for i in range(requests):
        samples = a if i == 0 else suite.client.generate(suite.prompt, **{**kw, "seed": 12 + i}).completions
        if len({tuple(x.token_ids) for x in samples}) > 1:
            return f"n={n} samples at temperature {temperature:g} differ (request {i + 1})"
    raise CheckFailed(f"the n={n} samples of one prompt were all identical in {requests} requests with different "
                      f"seeds at temperature {temperature:g}; independent samples are with probability at most "
                      f"{p_same:.3g} each time")


def check_logprobs_greedy(suite: Suite) -> str:
    c = suite.greedy(24)
    problem = mismatch(c, suite.ref.logits(suite.state, suite.prompt, c.token_ids), 0, suite.settings.atol)
    expect(problem is None, f"greedy: {problem}")
    return f"24 tokens within atol {suite.settings.atol:g}"


def check_logprobs_sampled(suite: Suite) -> str:
    out = suite.client.generate(suite.prompt, temperature=0.7, max_new_tokens=16, n=2, seed=5, ignore_eos=True)
    for i, c in enumerate(out.completions):
        problem = mismatch(c, suite.ref.logits(suite.state, suite.prompt, c.token_ids), 0.7, suite.settings.atol)
        expect(problem is None, f"sample {i} at temperature 0.7: {problem}")
    return "2 x 16 tokens at temperature 0.7"


def check_stop_and_length(suite: Suite) -> str:
    greedy = suite.greedy(10)
    stop_at = greedy.token_ids[3]
    k = greedy.token_ids.index(stop_at)
    out = suite.greedy(10, stop_token_ids=[stop_at])
    expect(out.finish_reason == "stop", f"finish_reason {out.finish_reason!r} at a stop token, expected stop")
    expect(out.token_ids == greedy.token_ids[:k + 1],
           f"tokens {out.token_ids}, expected the greedy ones up to and including the stop token "
           f"{greedy.token_ids[:k + 1]}")
    room = 5
    max_len = suite.info.max_model_len
    long_prompt = (suite.prompt * (max_len // len(suite.prompt) + 1))[:max_len - room]
    c = suite.client.generate(long_prompt, temperature=0, max_new_tokens=room + 50,
                              ignore_eos=True).completions[0]
    expect(c.finish_reason == "length" and len(c.token_ids) == room,
           f"at the end of the context: {len(c.token_ids)} tokens, finish {c.finish_reason!r}; expected {room}, "
           "length")
    return ""


def check_stop_strings(suite: Suite) -> str:
    from pipelinerl.engines.stops import decoder, stop_position

    tokenizer = suite.local_tokenizer()
    n = 32
    greedy = suite.greedy(n)
    ids = greedy.token_ids
    decode = decoder(tokenizer)
    texts = [decode(ids[:k]) for k in range(n + 1)]  # texts[k]: the first k tokens decoded
    never = "<conformance: a stop string that is not generated>"
    while never in texts[n]:
        never += "!"
    picked = None
    for stop, kind, token in _stop_candidates(texts):
        cut = stop_position(tokenizer, ids, [stop])
        # Past the first token (engines may decode it in the prompt's context: a leading space, say) and
        # before the last (an engine ignoring stop strings would return the same tokens)
        if cut is None or not 1 <= cut < n - 1:
            continue
        if kind == "inside a token" and cut != token:  # it occurs earlier: a fallback at most
            picked = picked or (stop, "at an earlier occurrence", cut)
            continue
        picked = (stop, kind, cut)
        break
    if picked is None:
        raise Skipped(f"the greedy text {texts[n]!r} offers no stop string to choose after its first token")
    stop, kind, cut = picked
    want = ids[:cut + 1]
    try:
        out = suite.greedy(n, stop=[never, stop])
    except EngineError as e:
        if e.status == 400 and normalized_field(e.field) == "sampling.stop" and "tokenizer" in e.message:
            raise Skipped(f"engine without a tokenizer: {e.message}") from None
        raise
    where = f"stop {stop!r} (ends {kind}, token {cut} of the greedy {n})"
    expect(len(out.logprobs) == len(out.versions) == len(out.token_ids),
           f"{where}: lengths token_ids/logprobs/versions {len(out.token_ids)}/{len(out.logprobs)}/"
           f"{len(out.versions)} differ")
    expect(out.token_ids == want and out.finish_reason == "stop",
           f"{where}: {len(out.token_ids)} tokens, finish {out.finish_reason!r}; expected the greedy tokens up to "
           f"and including the one that completes it ({cut + 1}), stop. Text returned: "
           f"{decode(out.token_ids)!r}, the greedy text: {texts[n]!r}")
    diff = max(abs(a - b) for a, b in zip(out.logprobs, greedy.logprobs))
    expect(diff <= suite.settings.atol, f"{where}: log-probs differ from the greedy run's by {diff:.2e}")
    last = suite.greedy(cut + 1, stop=[stop])
    expect(last.token_ids == want and last.finish_reason == "stop",
           f"{where} completed by the last allowed token (max_new_tokens {cut + 1}): finish "
           f"{last.finish_reason!r}, {len(last.token_ids)} tokens; expected stop, {cut + 1}")
    none = suite.greedy(n, stop=[never])
    expect(none.token_ids == ids and none.finish_reason == "length",
           f"a stop string that is not generated changed the output: {len(none.token_ids)} tokens, finish "
           f"{none.finish_reason!r}")
    return f"{where}; {_completions_stop(suite)}"


def _completions_stop(suite: Suite) -> str:
    """`/v1/completions` with an OpenAI-style stop string: the text ends at the end of the stop string."""
    body = {"prompt": "1+1=", "max_tokens": 24, "temperature": 0}
    r = suite.post("/v1/completions", body)
    if r.status_code == 400 and (error_of(r) or {}).get("field") == "prompt":
        return "/v1/completions: no tokenizer"
    expect(r.status_code == 200, f"/v1/completions answered {r.status_code}: {r.text[:300]}")
    text = r.json()["choices"][0]["text"]
    start = len(text) // 2
    stop = text[start:start + 3]
    if len(text) < 6 or not stop.strip():
        return f"/v1/completions: text {text!r} too short to cut"
    r = suite.post("/v1/completions", {**body, "stop": stop})
    expect(r.status_code == 200, f"/v1/completions with stop {stop!r} answered {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    want = text[:text.find(stop) + len(stop)]
    expect(choice["text"] == want and choice["finish_reason"] == "stop",
           f"/v1/completions with stop {stop!r}: text {choice['text']!r}, finish {choice['finish_reason']!r}; "
           f"expected {want!r} (the text without stop: {text!r}), stop")
    return f"/v1/completions text cut after {stop!r}"


def check_queueing(suite: Suite) -> str:
    n = min(suite.info.max_running_seqs + 8, 264)
    with ThreadPoolExecutor(n) as pool, httpx.Client(base_url=suite.url, timeout=600, headers=suite.auth,
                                                     limits=httpx.Limits(max_connections=n + 8)) as http:
        def one(i: int) -> httpx.Response:
            body = {"prompt_token_ids": suite.prompt[: 2 + i % 4],
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": i}}
            return http.post("/v1/generate", json=body)

        responses = list(pool.map(one, range(n)))
    bad = [r for r in responses if r.status_code != 200]
    expect(not bad, f"{len(bad)} of {n} concurrent requests failed, e.g. {bad[0].status_code}: "
                    f"{bad[0].text[:200]}" if bad else "")
    lengths = {len(r.json()["completions"][0]["token_ids"]) for r in responses}
    expect(lengths == {4}, f"completion lengths {sorted(lengths)}, expected 4")
    return f"{n} concurrent requests, running limit {suite.info.max_running_seqs}"


def check_completions(suite: Suite) -> str:
    r = suite.post("/v1/completions", {"prompt": ["1+1=", "2+2="], "max_tokens": 5, "temperature": 0,
                                       "logprobs": 1})
    if r.status_code == 400 and (r.json().get("error") or {}).get("field") == "prompt":
        raise Skipped(f"engine has no tokenizer: {r.json()['error']['message']}")
    expect(r.status_code == 200, f"/v1/completions answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    expect(len(body["choices"]) == 2, f"{len(body['choices'])} choices for 2 prompts")
    for ch in body["choices"]:
        lp = ch["logprobs"]
        expect(lp is not None and len(lp["tokens"]) == len(lp["token_logprobs"]),
               "each choice needs logprobs with one log-prob per token")
    expect(body["usage"]["completion_tokens"] <= 10, "usage.completion_tokens exceeds 2 x max_tokens")
    return ""


def bad_inputs(suite: Suite) -> list[tuple[dict, str | tuple[str, ...]]]:
    """(body, the field its error must name: one, or a tuple of names any of which will do)."""
    info, p = suite.info, suite.prompt[:1]
    return [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": p * info.max_model_len}, "prompt_token_ids"),
        ({"prompt_token_ids": p + [info.vocab_size + 5]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": p + [-1]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": p, "sampling": {"temperature": -0.5}}, "sampling.temperature"),
        ({"prompt_token_ids": p, "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"prompt_token_ids": p, "sampling": {"top_k": -3}}, "sampling.top_k"),
        ({"prompt_token_ids": p, "sampling": {"max_new_tokens": 10**9}}, "sampling.max_new_tokens"),
        ({"prompt_token_ids": p, "sampling": {"n": 0}}, "sampling.n"),
        ({"prompt_token_ids": p, "sampling": {"n": min(info.max_running_seqs + 1, 1025)}}, "sampling.n"),
        ({"prompt_token_ids": p, "sampling": {"stop_token_ids": [info.vocab_size + 10**6]}},
         "sampling.stop_token_ids[0]"),
        ({"prompt_token_ids": p, "sampling": {"stop": [""]}}, ("sampling.stop[0]", "sampling.stop")),
        ({"prompt_token_ids": p, "sampling": {"stop": ["x"] * 17}}, "sampling.stop"),
        ({"prompt_token_ids": p, "sampling": {"temprature": 1}}, "sampling.temprature"),
        ({"prompt_token_ids": "hello"}, "prompt_token_ids"),
        ({"prompt_token_ids": p, "extra": True}, "extra"),
    ]


def check_bad_input(suite: Suite) -> str:
    failures = []
    for body, want in bad_inputs(suite):
        wanted_fields = want if isinstance(want, tuple) else (want,)
        r = suite.post("/v1/generate", body)
        err = error_of(r)
        if not 400 <= r.status_code < 500 or err is None:
            failures.append(f"{_short(body)}: {r.status_code} {r.text[:120]}")
        elif (normalized_field(err.get("field")) not in {normalized_field(w) for w in wanted_fields}
              or not err.get("message")):
            failures.append(f"{_short(body)}: error.field {err.get('field')!r}, expected {want!r}")
    r = suite.post("/v1/generate", content=b"{not json")
    if r.status_code != 400 or error_of(r) is None:
        failures.append(f"invalid JSON: {r.status_code} {r.text[:120]}")
    r = suite.post("/v1/weights/update", {"version": 1, "params": []})
    if not 400 <= r.status_code < 500 or normalized_field((error_of(r) or {}).get("field")) != "params":
        failures.append(f"update with no params: {r.status_code} {r.text[:120]}")
    expect(not failures, "; ".join(failures))
    c = suite.greedy(4)
    expect(len(c.token_ids) == 4, "the engine stopped serving after bad input")
    return f"{len(bad_inputs(suite)) + 2} bad requests"


def check_abort(suite: Suite) -> str:
    steps, seconds = suite.long_run()
    delay = 0.25 * seconds
    attempts = 5  # on a busy machine the timing of a generation varies: retry with another delay
    for attempt in range(attempts):
        prefix = f"conformance-{uuid.uuid4().hex[:6]}-"
        ids = [prefix + k for k in "abc"]
        running = {rid: suite.greedy_in_background(steps, request_id=rid) for rid in ids}
        time.sleep(delay)
        first = suite.client.abort(ids[0])
        rest = suite.client.abort(None)
        for thread, _ in running.values():
            thread.join(600)
        out = {rid: result.get("out") for rid, (_, result) in running.items()}
        for rid, c in out.items():
            expect(isinstance(c, Completion), f"{rid} ended with {c!r}")
        if not first:  # it had already finished: abort earlier
            expect(out[ids[0]].finish_reason == "length", f"abort({ids[0]!r}) returned [] for a running request")
            delay *= 0.3
            continue
        expect(first == [ids[0]], f"abort({ids[0]!r}) returned {first}")
        a = out[ids[0]]
        expect(a.finish_reason == "abort", f"aborted request: finish_reason {a.finish_reason!r}")
        if not a.token_ids and attempt < attempts - 1:  # aborted before its first token: abort later
            delay *= 3
            continue
        expect(0 < len(a.token_ids) < steps, f"aborted request returned {len(a.token_ids)} of {steps} tokens; "
                                             "expected the tokens generated so far")
        expect(len(a.logprobs) == len(a.versions) == len(a.token_ids), "aborted request: field lengths differ")
        for rid in ids[1:]:
            expect(rid in rest or out[rid].finish_reason == "length", f"abort(all) returned {rest}, not {rid!r}")
            if rid in rest:
                expect(out[rid].finish_reason == "abort",
                       f"{rid} after abort(all): finish_reason {out[rid].finish_reason!r}")
        expect(suite.client.abort("conformance-no-such-request") == [],
               "aborting an unknown id must abort nothing")
        return f"aborted after {len(a.token_ids)} of {steps} tokens (attempt {attempt + 1})"
    raise CheckFailed(f"every request finished before it could be aborted ({steps}-token generations, "
                      f"{attempts} tries)")


def _stop_candidates(texts: Sequence[str]) -> list[tuple[str, str, int]]:
    """(stop string, where it ends, the token it ends in) to try, best first, from texts[k] = the first k tokens
    decoded: strings that end strictly inside a token of several characters (that token's first character), then
    strings that end at a token boundary. None starts in the first token's text."""
    first = len(texts[1])
    inside, boundary = [], []
    for i in range(1, len(texts) - 1):
        before, after = texts[i], texts[i + 1]
        if not after.startswith(before) or "\ufffd" in after[len(before):]:  # tokens appending whole characters
            continue
        if len(after) - len(before) >= 2:
            end = len(before) + 1
            inside.append((after[max(first, end - 8):end], "inside a token", i))
        if len(after) > len(before) and i >= len(texts) // 3:
            boundary.append((after[max(first, len(after) - 8):], "at a token boundary", i))
    return [c for c in inside + boundary if c[0].strip()]


def _short(body: dict) -> str:
    """A request body cut to fit in a failure message."""
    text = json.dumps(body)
    return text if len(text) < 80 else text[:77] + "..."
