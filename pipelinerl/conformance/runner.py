"""The conformance suite's runner: `Suite` holds what the checks share about the engine under test (its client,
the weights it holds as far as the suite knows, the prompt) and runs the checks in order, one `Result` each; and
the command line (`pipelinerl conformance`) that prints them as a table."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import torch

from pipelinerl.auth import api_key_from_env, auth_headers
from pipelinerl.conformance import generation, weight_updates
from pipelinerl.conformance.outcomes import FAIL, PASS, SKIP, CheckFailed, Result, Skipped, expect
from pipelinerl.conformance.reference import Reference
from pipelinerl.contracts.inference import Completion, InfoResponse
from pipelinerl.engines.client import EngineClient, push_weights

Check = Callable[["Suite"], "str | None"]


@dataclass
class Settings:
    atol: float = 2e-3
    bucket_bytes: int = 0
    master_address: str = "127.0.0.1"
    timeout_s: float = 120.0
    in_flight_seconds: float = 3.0  # target length of the in-flight check's generation
    group_name: str = field(default_factory=lambda: f"conformance-{uuid.uuid4().hex[:8]}")


# (name, what it proves, the check), in the order they run: the checks that leave the weights alone first, then
# those that join the weight-update group and change them
_CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("health_info", "health, info and metrics routes; contract version; vocabulary matches the model",
     generation.check_health_info),
    ("generate_fields", "completions carry token ids, log-probs, versions and finish reasons; n and seed",
     generation.check_generate_fields),
    ("logprobs_greedy", "greedy tokens and log-probs match a rescoring of the same tokens",
     generation.check_logprobs_greedy),
    ("logprobs_sampled", "sampled log-probs are log softmax(logits / temperature) of the rescoring",
     generation.check_logprobs_sampled),
    ("stop_and_length", "stop tokens end a completion (included); length at max_new_tokens and context",
     generation.check_stop_and_length),
    ("stop_strings", "stop strings end a completion at the token that completes one (kept whole)",
     generation.check_stop_strings),
    ("queueing", "requests beyond the running limit queue and finish; none is refused",
     generation.check_queueing),
    ("completions", "OpenAI-style /v1/completions",
     generation.check_completions),
    ("bad_input", "bad input is a 4xx whose error.field names the field; the server keeps serving",
     generation.check_bad_input),
    ("abort", "abort one and all: finish reason abort with the tokens so far; unknown ids abort nothing",
     generation.check_abort),
    ("group_init", "joining the weight-update group; an update for another group is a 409",
     weight_updates.check_group_init),
    ("update_identical", "an update with the same weights keeps greedy outputs; new tokens carry its version",
     weight_updates.check_update_identical),
    ("update_changes", "an update with new weights changes outputs to the new model's",
     weight_updates.check_update_changes),
    ("in_flight_update", "an update during a long generation switches it mid-way, keeping its KV cache",
     weight_updates.check_in_flight_update),
    ("refused_update", "a mismatched update is refused naming the parameter; weights stay unchanged",
     weight_updates.check_refused_update),
)
_CHECK_BY_NAME: dict[str, Check] = {name: check for name, _, check in _CHECKS}


class Suite:
    """Every check of the contract against one engine. `run()` returns one `Result` per check, in order."""

    def __init__(self, url: str, model_path: str, settings: Settings | None = None,
                 log: Callable[[str], None] | None = None):
        self.url = url.rstrip("/")
        self.settings = settings or Settings()
        self.log = log or (lambda _: None)
        self.client = EngineClient(self.url, timeout_s=max(600.0, self.settings.timeout_s))
        self.auth = auth_headers(api_key_from_env())  # an engine with a key (pipelinerl/auth.py) needs it
        self.model_path = model_path
        self.ref = Reference(model_path)
        self._tokenizer = None
        self.group = None
        self.version = 0
        self.state = self.ref.base  # the weights the engine holds, as far as the suite knows
        self.info: InfoResponse | None = None
        self.prompt: list[int] = []
        self._per_token_s: float | None = None
        self._long: tuple[int, float] | None = None

    CHECKS: tuple[tuple[str, str], ...] = tuple((name, proves) for name, proves, _ in _CHECKS)
    _NEEDS_GROUP = {"update_identical", "update_changes", "in_flight_update", "refused_update"}

    def run(self, only: Sequence[str] | None = None) -> list[Result]:
        results: list[Result] = []
        try:
            self.info = self.client.info()
            self.version = self.info.weight_version
            self.prompt = self._make_prompt(6)
        except Exception as e:
            return [Result("health_info", FAIL, f"GET /v1/info failed: {e}")]
        wanted = [n for n, _ in self.CHECKS if not only or n in only]
        if "group_init" not in wanted and any(n in self._NEEDS_GROUP for n in wanted):
            first = min(wanted.index(n) for n in wanted if n in self._NEEDS_GROUP)
            wanted.insert(first, "group_init")  # the update checks need the group
        try:
            for name in wanted:
                if name in self._NEEDS_GROUP and self.group is None:
                    results.append(Result(name, SKIP, "no weight-update group (group_init failed)"))
                else:
                    results.append(self._run_one(name, _CHECK_BY_NAME[name]))
        finally:
            self._restore()
            self.client.close()
        return results

    def _run_one(self, name: str, check: Check) -> Result:
        self.log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            detail = check(self) or ""
            status = PASS
        except Skipped as e:
            status, detail = SKIP, str(e)
        except CheckFailed as e:
            status, detail = FAIL, str(e)
        except Exception as e:  # an engine error or a broken connection fails the check, not the suite
            status, detail = FAIL, f"{type(e).__name__}: {e}"
        return Result(name, status, detail, time.perf_counter() - t0)

    def _restore(self) -> None:
        """Push the original weights back, so the engine serves what it served before the suite."""
        if self.group is None:
            return
        try:
            if self.state is not self.ref.base:
                self.push(self.ref.base)
        except Exception as e:
            self.log(f"could not restore the original weights: {e}")
        finally:
            self.group.destroy()
            self.group = None

    # --- what the checks share -----------------------------------------------------------------------------

    def _make_prompt(self, n: int) -> list[int]:
        """n random tokens, none EOS; where --model has a tokenizer, none special and each with visible text of
        its own, so that a model that repeats its input's last token still writes text to cut with stop strings."""
        eos = set(self.info.eos_token_ids) if self.info else set()
        vocab = min(self.ref.vocab_size, self.info.vocab_size if self.info else self.ref.vocab_size)
        g = torch.Generator().manual_seed(7)
        ids = [int(t) for t in torch.randint(3, vocab, (64 * n,), generator=g) if int(t) not in eos]
        try:
            tokenizer = self.local_tokenizer()
        except Skipped:
            return ids[:n]
        special = set(tokenizer.all_special_ids)

        def visible(t: int) -> bool:
            text = tokenizer.decode([t], skip_special_tokens=True)
            return t not in special and bool(text.strip()) and "\ufffd" not in text

        shown = [t for t in ids if visible(t)]
        return shown[:n] if len(shown) >= n else ids[:n]

    def greedy(self, max_new: int, **kw: Any) -> Completion:
        """One greedy completion of the prompt, ignoring EOS (`kw`: more sampling fields, or a request id)."""
        return self.client.generate(self.prompt, temperature=0, max_new_tokens=max_new, ignore_eos=True,
                                    **kw).completions[0]

    def greedy_in_background(self, max_new: int, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
        """`greedy` on a thread, for a check to intervene while it runs; its completion (or exception) lands in
        the dict under "out"."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["out"] = self.greedy(max_new, **kw)
            except Exception as e:
                result["out"] = e

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread, result

    def push(self, state: dict[str, torch.Tensor], bucket_bytes: int | None = None):
        """Send `state` to the engine as the next weight version (the suite's wire format unless `bucket_bytes`)."""
        version = self.version + 1
        bb = self.settings.bucket_bytes if bucket_bytes is None else bucket_bytes
        resp = push_weights(self.group, [self.client], self.ref.named(state), version, bb)[0]
        self.version, self.state = version, state
        return resp

    def post(self, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
        """A raw POST (JSON `body`, or bytes `content` as JSON), so checks see the status and error the engine
        sends rather than the client's exception."""
        if content is not None:
            return httpx.post(f"{self.url}{path}", content=content,
                              headers={"content-type": "application/json", **self.auth},
                              timeout=60)
        return httpx.post(f"{self.url}{path}", json=body, timeout=60, headers=self.auth)

    def _per_token(self) -> float:
        """Seconds per token of one greedy sequence on this engine (measured once)."""
        if self._per_token_s is None:
            t0 = time.perf_counter()
            self.greedy(64)
            self._per_token_s = (time.perf_counter() - t0) / 64
        return self._per_token_s

    def long_run(self) -> tuple[int, float]:
        """(tokens, seconds) of a long greedy generation on this engine, measured once: the in-flight and abort
        checks time their interventions from it (there is no engine-neutral way to watch a request's
        progress)."""
        if self._long is None:
            room = self.info.max_model_len - len(self.prompt) - 1
            if room < 32:
                raise Skipped(f"max_model_len {self.info.max_model_len} leaves no room for a long generation")
            steps = max(32, min(int(self.settings.in_flight_seconds / max(self._per_token(), 1e-5)), 1000, room))
            t0 = time.perf_counter()
            c = self.greedy(steps)
            expect(len(c.token_ids) == steps, f"a {steps}-token generation returned {len(c.token_ids)} tokens")
            self._long = (steps, time.perf_counter() - t0)
        return self._long

    def checksums(self) -> dict[str, str] | None:
        """The engine's per-parameter weight checksums, or None where it does not implement the route (501)."""
        r = httpx.get(f"{self.url}/v1/weights/checksum", timeout=120, headers=self.auth)
        if r.status_code == 501:
            return None
        expect(r.status_code == 200, f"GET /v1/weights/checksum answered {r.status_code}: {r.text[:200]}")
        return r.json()["checksums"]

    def local_tokenizer(self):
        """The tokenizer of --model, which decodes as the contract defines stop strings."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as e:
                raise Skipped(f"--model has no tokenizer to decode with ({type(e).__name__}: {e})") from None
        return self._tokenizer

    def _spread_temperature(self, n: int) -> tuple[float, float]:
        """The lowest temperature (from 1 up to the contract's 100) at which n samples of the prompt's first
        token all agree with probability at most 0.05 by this model's rescoring (or 100 if none), and that
        probability. A confident model needs a high one: at temperature 1 its samples are all the same."""
        logits = self.ref.next_logits(self.state, self.prompt)
        for temperature in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0):
            p_same = float(torch.softmax(logits / temperature, -1).double().pow(n).sum())
            if p_same <= 0.05:
                break
        return temperature, p_same


# --- command line ------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--model", required=True, help="local copy of the model the engine serves (the suite's trainer)")
    p.add_argument("--only", default="", help="comma-separated checks to run (default: all): "
                   + ", ".join(n for n, _ in Suite.CHECKS))
    p.add_argument("--atol", type=float, default=Settings.atol, help="log-prob tolerance against the rescoring")
    p.add_argument("--bucket-bytes", type=int, default=0, help="wire format of the pushed updates (0: per tensor)")
    p.add_argument("--master-address", default="127.0.0.1", help="address the engine reaches this process on")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the group to form")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def format_table(results: Sequence[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  result  seconds  detail", "-" * (width + 40)]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.2f}  {r.detail}")
    failed = sum(r.status == FAIL for r in results)
    lines.append(f"{len(results) - failed} of {len(results)} checks did not fail ({failed} failed, "
                 f"{sum(r.status == SKIP for r in results)} skipped)")
    return "\n".join(lines)


def run_suite(url: str, model: str, only: Sequence[str] | None = None, settings: Settings | None = None,
              log: Callable[[str], None] | None = None) -> list[Result]:
    """Run the suite against `url` (the API the tests use)."""
    return Suite(url, model, settings, log).run(only)


def main(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from pipelinerl.cli_args import model_directory

    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        print(f"pipelinerl conformance: --url {args.url!r}: must be an engine's base URL such as "
              "http://127.0.0.1:8100", file=sys.stderr)
        return 2
    args.model = model_directory(args.model)
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - {n for n, _ in Suite.CHECKS}
    if unknown:
        print(f"pipelinerl conformance: unknown check(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    settings = Settings(atol=args.atol, bucket_bytes=args.bucket_bytes, master_address=args.master_address,
                        timeout_s=args.timeout)
    results = run_suite(args.url, args.model, only, settings, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 1 if any(r.status == FAIL for r in results) else 0
