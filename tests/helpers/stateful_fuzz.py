"""A stateful fuzzer of an engine's HTTP front, with this process as its trainer (tests/test_fuzz_stateful.py, and
`make fuzz` for a long run).

Schema-driven fuzzing (tests/test_fuzz.py) sends one request at a time against an engine in no group. This one
walks random sequences of the contract's operations in the states where they mean something: generations (valid,
out of bounds, with stop strings, seeded) running while the engine joins a real weight-update group (hosted here),
takes pushed updates (whole, partial, refused: a wrong shape, a wrong name, before joining), is asked to abort, and
joins rendezvous that cannot form. After every step it checks the contract: only the statuses each operation may
answer (the one 5xx the contract prescribes, 504 for a transfer that cannot happen), every error in the envelope,
the weight version and, where the engine has them, the weights' checksums exactly what was pushed (a refused update
leaves them untouched), a valid generation answered 200 with as many tokens as asked for at most and versions no
older than the weights it started on. The seed is printed; a failure names the step and the seed to replay it.
"""

from __future__ import annotations

import concurrent.futures
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from pipelinerl.conformance import Reference
from pipelinerl.engines.client import EngineClient, EngineError, init_group_on_engines, push_weights
from pipelinerl.engines.embedded.engine import tensor_checksums
from pipelinerl.procs import free_port
from pipelinerl.weight_sync import WeightUpdateGroup, init_weight_update_group

ALLOWED = {  # operation -> statuses it may answer
    "generate": {200, 400, 409}, "generate_bad": {400}, "completions": {200, 400}, "abort": {200},
    "update": {200}, "update_refused": {400}, "update_no_group": {409}, "join_bad": {504}, "info": {200},
    "checksum": {200, 501}, "metrics": {200}, "health": {200},
}


@dataclass
class Tally:
    steps: int = 0
    requests: int = 0
    statuses: dict[tuple[str, int], int] = field(default_factory=dict)

    def count(self, op: str, status: int) -> None:
        self.requests += 1
        self.statuses[(op, status)] = self.statuses.get((op, status), 0) + 1

    def summary(self) -> str:
        return f"{self.steps} steps, {self.requests} requests: " + ", ".join(
            f"{op} {status} x{n}" for (op, status), n in sorted(self.statuses.items()))


class StatefulFuzzer:
    def __init__(self, client: EngineClient, model_dir: str, seed: int, checksums: bool = True):
        self.client, self.seed, self.rng = client, seed, random.Random(seed)
        self.url = client.url
        self.headers = dict(client._headers)
        self.ref = Reference(model_dir)
        self.info = client.info()
        self.vocab = self.info.vocab_size
        self.max_len = self.info.max_model_len
        self.checksums = checksums
        self.group: WeightUpdateGroup | None = None
        self.group_name: str | None = None
        self.version = self.info.weight_version
        self.state = dict(self.ref.base)  # what the engine should hold
        self.tally = Tally()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=6)
        self.in_flight: list[tuple[concurrent.futures.Future, str, int]] = []
        self.lock = threading.Lock()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.closed_port = s.getsockname()[1]  # (released: nothing listens there; a join to it is refused)

    # --- the walk ------------------------------------------------------------------------------------------------

    def run(self, steps: int) -> Tally:
        ops = [(self.generate, 8), (self.generate_bad, 4), (self.completions, 2), (self.abort, 2), (self.join, 1),
               (self.join_bad, 1), (self.update, 3), (self.update_partial, 2), (self.update_refused, 2),
               (self.update_no_group, 1), (self.probe, 2)]
        weights = [w for _, w in ops]
        try:
            for step in range(steps):
                self.tally.steps = step + 1
                op = self.rng.choices([f for f, _ in ops], weights)[0]
                try:
                    op()
                    self._reap(block=False)
                except AssertionError as e:
                    raise AssertionError(f"step {step} ({op.__name__}), seed {self.seed}: {e}") from None
            self._reap(block=True)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.group is not None:
                self.group.destroy()
        return self.tally

    # --- generation ----------------------------------------------------------------------------------------------

    def _sampling(self) -> dict:
        r = self.rng
        s: dict[str, Any] = {"max_new_tokens": r.randint(1, 12), "temperature": r.choice([0, 0.7, 1.0, 1.5]),
                             "ignore_eos": r.random() < 0.5, "n": r.choice([1, 1, 2, 3])}
        if r.random() < 0.3:
            s["top_k"] = r.choice([1, 5, self.vocab, self.vocab * 10, 2**31 - 1])
        if r.random() < 0.3:
            s["top_p"] = r.choice([0.1, 0.5, 0.9, 1.0])
        if r.random() < 0.3:
            s["seed"] = r.randint(0, 2**53 - 1)
        if r.random() < 0.2:
            s["stop_token_ids"] = [r.randrange(self.vocab) for _ in range(r.randint(1, 3))]
        return s

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 16))]

    def generate(self) -> None:
        body = {"prompt_token_ids": self._prompt(), "sampling": self._sampling()}
        if self.rng.random() < 0.3:
            body["request_id"] = f"fuzz-{self.rng.randrange(8)}"  # may collide with one in flight: 409
        started_version = self.version
        future = self.pool.submit(self._post, "/v1/generate", body)
        self.in_flight.append((future, "generate", started_version))
        future.body = body  # type: ignore[attr-defined]

    def generate_bad(self) -> None:
        """A generation with one field out of the contract's bounds, sent beside the others."""
        body = {"prompt_token_ids": self._prompt(), "sampling": self._sampling()}
        r = self.rng
        which = r.randrange(7)
        if which == 0:
            body["sampling"]["top_k"] = r.choice([2**31, 8354693991844048242084937728, -1])
        elif which == 1:
            body["prompt_token_ids"][0] = r.choice([self.vocab, 2**31, 2**64, -5])
        elif which == 2:
            body["sampling"]["max_new_tokens"] = r.choice([0, 10**7, 2**70])
        elif which == 3:
            body["sampling"]["seed"] = r.choice([2**53, 2**64, -1])
        elif which == 4:
            body["sampling"]["n"] = r.choice([0, 10**6])
        elif which == 5:
            body["prompt_token_ids"] = [1] * (self.max_len + r.randint(0, 5))
        else:
            body["sampling"]["temperature"] = r.choice([-1, 1e9])
        future = self.pool.submit(self._post, "/v1/generate", body)
        self.in_flight.append((future, "generate_bad", self.version))

    def completions(self) -> None:
        body = {"prompt": "1+1=" * self.rng.randint(1, 3), "max_tokens": self.rng.randint(1, 8),
                "temperature": self.rng.choice([0, 1.0])}
        future = self.pool.submit(self._post, "/v1/completions", body)
        self.in_flight.append((future, "completions", self.version))

    def abort(self) -> None:
        body = {} if self.rng.random() < 0.3 else {"request_id": f"fuzz-{self.rng.randrange(8)}"}
        self._check("abort", self._post("/v1/abort", body))

    def _reap(self, block: bool) -> None:
        keep = []
        for future, op, started in self.in_flight:
            if not block and not future.done():
                keep.append((future, op, started))
                continue
            resp = future.result(timeout=300)
            self._check(op, resp)
            if op == "generate" and resp.status_code == 200:
                self._check_generation(future.body, resp.json(), started)  # type: ignore[attr-defined]
        self.in_flight = keep

    def _check_generation(self, body: dict, answer: dict, started: int) -> None:
        s = body["sampling"]
        assert len(answer["completions"]) == s["n"], answer
        for c in answer["completions"]:
            assert 1 <= len(c["token_ids"]) <= s["max_new_tokens"] or c["finish_reason"] == "abort", c
            assert len(c["token_ids"]) == len(c["logprobs"]) == len(c["versions"]), c
            assert all(0 <= t < self.vocab for t in c["token_ids"]), c
            assert all(v >= started for v in c["versions"]), (started, c["versions"])
            assert all(lp <= 1e-4 for lp in c["logprobs"]), c

    # --- weights -------------------------------------------------------------------------------------------------

    def join(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        port = free_port()
        name = f"fuzz-{self.rng.randrange(10**6)}"
        world, futures = init_group_on_engines([self.client], "127.0.0.1", port, "gloo", name, 60)
        self.group = init_weight_update_group("127.0.0.1", port, 0, world, "gloo", name, 60)
        for f in futures:
            f.result()
        self.group_name = name
        self.tally.count("join", 200)
        assert self.client.info().weight_group == name

    def join_bad(self) -> None:
        """A rendezvous that cannot form: 504 within its timeout, and the engine left in no group."""
        resp = self._post("/v1/weights/init_group", {
            "master_address": "127.0.0.1", "master_port": self.closed_port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "never", "timeout_s": 0.5})
        self._check("join_bad", resp)
        if self.group is not None:  # it left the group it was in to try
            self.group.destroy()
        self.group, self.group_name = None, None

    def _push(self, names: list[str], scale: float) -> None:
        g = torch.Generator().manual_seed(self.rng.randrange(2**31))
        named = [(n, self.ref.base[n] + scale * self.ref.base[n].std() * torch.randn(self.ref.base[n].shape,
                                                                                       generator=g))
                 for n in names]
        self.version += 1
        push_weights(self.group, [self.client], named, self.version, self.rng.choice([0, 4096]))
        self.state.update(named)
        self.tally.count("update", 200)
        self._check_weights()

    def update(self) -> None:
        if self.group is None:
            self.join()
        self._push(list(self.ref.base), self.rng.choice([0.0, 0.1, 0.3]))

    def update_partial(self) -> None:
        if self.group is None:
            self.join()
        names = self.rng.sample(list(self.ref.base), self.rng.randint(1, 3))
        self._push(names, 0.2)

    def update_refused(self) -> None:
        """A wrong shape (or name) in the update: 400 after the broadcast is drained, weights untouched."""
        if self.group is None:
            self.join()
        name = self.rng.choice(list(self.ref.base))
        t = self.ref.base[name]
        bad = torch.zeros(t.numel() + 1) if self.rng.random() < 0.5 else t.clone()
        bad_name = name if bad.shape != t.shape else name + ".nope"
        try:
            push_weights(self.group, [self.client], [(bad_name, bad)], self.version + 1)
        except EngineError as e:
            assert "answered 400" in str(e), e
            self.tally.count("update_refused", 400)
        else:
            raise AssertionError("a mismatched update was taken")
        self._check_weights()

    def update_no_group(self) -> None:
        resp = self._post("/v1/weights/update", {"version": self.version + 1, "group_name": "not-joined",
                                                 "params": [{"name": "x", "dtype": "float32", "shape": [1]}]})
        self._check("update_no_group", resp)

    def _check_weights(self) -> None:
        info = self.client.info()
        assert info.weight_version == self.version, (info.weight_version, self.version)
        if not self.checksums:
            return
        got = httpx.get(f"{self.url}/v1/weights/checksum", headers=self.headers, timeout=60).json()
        expected = tensor_checksums({n: t.to(torch.float32) for n, t in self.state.items()})
        assert {n: got["checksums"][n] for n in expected} == expected, "the weights are not what was pushed"

    # --- status --------------------------------------------------------------------------------------------------

    def probe(self) -> None:
        for path, op in (("/v1/info", "info"), ("/v1/health", "health"), ("/metrics", "metrics"),
                         ("/v1/weights/checksum", "checksum")):
            self._check(op, httpx.get(f"{self.url}{path}", headers=self.headers, timeout=60))

    # --- the contract's checks -----------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=300)

    def _check(self, op: str, resp: httpx.Response) -> None:
        self.tally.count(op, resp.status_code)
        assert resp.status_code in ALLOWED[op], f"{op} answered {resp.status_code}: {resp.text[:300]}"
        if resp.status_code >= 400:
            body = resp.json()
            assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "field"}, body


def fuzz(client: EngineClient, model_dir: str, seed: int, steps: int, checksums: bool = True) -> Tally:
    started = time.monotonic()
    tally = StatefulFuzzer(client, model_dir, seed, checksums).run(steps)
    print(f"stateful fuzzing, seed {seed}: {tally.summary()} in {time.monotonic() - started:.0f} s")
    return tally
