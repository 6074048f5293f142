"""The inference contract's conformance suite: checks any engine's URL against `contracts/README.md`.

`pipelinerl conformance --url http://127.0.0.1:8100 --model PATH` runs every check and prints a PASS/FAIL
table (exit status 1 on any failure). PATH is a local copy of the model the engine serves: this process acts
as the trainer (rank 0 of a gloo weight-update group, pushing the same weights and changed ones) and rescores
the engine's tokens with it, so log-probs and in-flight switches are checked against an independent
computation rather than against the engine itself. What the checks expect holds for any causal LM: changed
weights negate the logits (so every greedy token changes, even for a model that repeats one token), and
samples are drawn at a temperature at which this model's samples differ.

The suite changes the engine's weights while it runs and pushes the original weights back at the end (the
engine's weight version ends higher than it started). It leaves the engine in this process's weight-update
group; a trainer that calls `init_group` afterwards replaces it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import torch

from pipelinerl.auth import api_key_from_env, auth_headers
from pipelinerl.contracts.inference import CONTRACT_VERSION, Completion, InfoResponse
from pipelinerl.engines.client import EngineClient, EngineError, init_group_on_engines, push_weights

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class CheckFailed(AssertionError):
    """A contract violation, with a message that says what was expected and what came back."""


class Skipped(Exception):
    """The check does not apply to this engine (the reason says why)."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Result:
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


# --- the trainer's side: the local model -------------------------------------------------------------------


class Reference:
    """The local copy of the served model: the weights the suite pushes, and an independent rescoring of the
    engine's tokens under them (transformers, float32)."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # parameters only, deduplicated (a tied lm_head follows the embedding), in a fixed order: what a
        # trainer sends
        self.base = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._loaded: dict[str, torch.Tensor] | None = None
        self._flip_names: list[str] | None = None

    def named(self, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(n, state[n]) for n in self.base]

    def perturbed(self, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
        """The base weights with Gaussian noise of `scale` standard deviations added to every matrix (vectors
        kept). It changes every layer, so the KV cache computed under it differs from the base's, but it need not
        change any greedy token: a freshly initialised model with tied embeddings repeats its input's last token
        with or without it."""
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
                for k, v in self.base.items()}

    def flipped(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """`state` with every output logit negated (the same hidden states, -logits), or None where this model
        has no parameters that do that. Under it every greedy token is the base's least likely one, so whatever
        the model (confident, random, repeating one token), the argmax changes at every position whose logits
        are not all equal."""
        names = self.flip_names
        return None if names is None else {k: -v if k in names else v for k, v in state.items()}

    @property
    def flip_names(self) -> list[str] | None:
        """The parameters the logits are linear in and nothing else reads: an untied head's weight and bias, or
        with a tied head (which is also the input embedding) the final norm's scale and shift. Found by running
        the model, and used only if negating them negates the logits exactly on a probe."""
        if self._flip_names is None:
            self._flip_names = self._find_flip_names() or []
        return self._flip_names or None

    @torch.no_grad()
    def _find_flip_names(self) -> list[str] | None:
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head is None or not list(head.parameters(recurse=False)):
            return None
        names = {id(p): n for n, p in self.model.named_parameters()}
        probe = torch.arange(8)[None] % self.vocab_size
        self._load(self.base)
        if getattr(head, "weight", None) is not getattr(embedding, "weight", None):
            found = [names[id(p)] for p in head.parameters(recurse=False)]
        else:  # the module whose output the head multiplies: the last one run before it with that output
            outputs: list[tuple[torch.nn.Module, Any]] = []
            head_input: list[torch.Tensor] = []
            hooks = [m.register_forward_hook(lambda m, _, out: outputs.append((m, out)))
                     for m in self.model.modules() if m is not head and list(m.parameters(recurse=False))]
            hooks.append(head.register_forward_pre_hook(lambda _, args: head_input.append(args[0])))
            try:
                self.model(probe)
            finally:
                for h in hooks:
                    h.remove()
            if not head_input:
                return None
            x = head_input[0]
            feeding = [m for m, out in outputs if isinstance(out, torch.Tensor) and out.shape == x.shape
                       and torch.equal(out, x)]
            if not feeding:
                return None
            found = [names[id(p)] for p in feeding[-1].parameters(recurse=False) if id(p) in names]
        if not found or not set(found) <= set(self.base):
            return None
        logits = self.model(probe).logits
        self._load({k: -v if k in found else v for k, v in self.base.items()})
        flipped = self.model(probe).logits
        scale = float(logits.abs().max()) + 1e-6
        return found if torch.allclose(flipped, -logits, rtol=1e-4, atol=1e-5 * scale) else None

    def changed(self, seed: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """New weights to push, with what they are, best first: noise in every layer with the logits negated
        (the greedy tokens change, and so does the KV cache), then the logits negated alone (the body, hence the
        KV cache, kept: a fallback where the noise happens to undo the negation). A model without such
        parameters gets stronger and stronger noise, and the checks verify with this model whether it shows."""
        noisy = self.perturbed(seed)
        flipped_noisy, flipped_base = self.flipped(noisy), self.flipped(self.base)
        if flipped_noisy is not None and flipped_base is not None:
            return [("noise in every matrix and the logits negated", flipped_noisy),
                    ("the logits negated", flipped_base)]
        return [(f"noise of {s:g} standard deviations in every matrix", self.perturbed(seed, s))
                for s in (0.5, 1.0, 2.0)]

    @torch.no_grad()
    def next_logits(self, state: dict[str, torch.Tensor], prompt: Sequence[int]) -> torch.Tensor:
        """Logits of the first token generated after `prompt` ([vocab])."""
        self._load(state)
        return self.model(torch.tensor([list(prompt)])).logits[0, -1].float()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        if self._loaded is not state:
            self.model.load_state_dict(state, strict=False)
            self._loaded = state

    @torch.no_grad()
    def logits(self, state: dict[str, torch.Tensor], prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Logits that predicted each of `tokens` after `prompt` ([len(tokens), vocab])."""
        self._load(state)
        ids = torch.tensor([list(prompt) + list(tokens)])
        return self.model(ids).logits[0, len(prompt) - 1:-1].float()

    @torch.no_grad()
    def logits_switched(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], prompt: Sequence[int],
                        tokens: Sequence[int], switch: int) -> torch.Tensor:
        """What an in-flight switch computes: tokens[:switch] from `old`; the rest from `new`, attending to a KV
        cache of prompt + tokens[:switch - 1] computed under `old`."""
        self._load(old)
        out = self.model(torch.tensor([list(prompt) + list(tokens[:switch - 1])]), use_cache=True)
        before = out.logits[0, len(prompt) - 1:]
        self._load(new)
        after = self.model(torch.tensor([list(tokens[switch - 1:-1])]), past_key_values=out.past_key_values,
                           use_cache=True).logits[0]
        return torch.cat([before, after]).float()


def mismatch(c: Completion, logits: torch.Tensor, temperature: float, atol: float) -> str | None:
    """Why the engine's tokens and log-probs disagree with `logits`, or None.

    Log-probs must equal log softmax(logits / temperature) at the sampled token (temperature 1 when greedy)
    within `atol`; a greedy token must be the argmax (within `atol`, so that near-ties do not fail)."""
    t = temperature if temperature > 0 else 1.0
    tokens = torch.tensor(c.token_ids)
    logprobs = torch.log_softmax(logits / t, dim=-1)
    expected = logprobs.gather(1, tokens[:, None])[:, 0]
    diff = (expected - torch.tensor(c.logprobs)).abs()
    if diff.numel() and float(diff.max()) > atol:
        i = int(diff.argmax())
        return (f"token {i}: log-prob {c.logprobs[i]:.6f}, the rescoring gives {float(expected[i]):.6f} "
                f"(|diff| {float(diff[i]):.2e} > atol {atol:g})")
    if temperature == 0:
        gap = logprobs.max(dim=-1).values - expected
        if gap.numel() and float(gap.max()) > atol:
            i = int(gap.argmax())
            return (f"greedy token {i} is {c.token_ids[i]}, the rescoring's argmax is "
                    f"{int(logprobs[i].argmax())} (by {float(gap[i]):.4f} in log-prob)")
    return None


# --- the suite ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    atol: float = 2e-3
    bucket_bytes: int = 0
    master_address: str = "127.0.0.1"
    timeout_s: float = 120.0
    in_flight_seconds: float = 3.0  # target length of the in-flight check's generation
    group_name: str = field(default_factory=lambda: f"conformance-{uuid.uuid4().hex[:8]}")


class Suite:
    """Every check of the contract against one engine. `run()` returns one `Result` per check, in order."""

    def __init__(self, url: str, model_path: str, settings: Settings | None = None,
                 log: Callable[[str], None] | None = None):
        self.url = url.rstrip("/")
        self.s = settings or Settings()
        self.log = log or (lambda _: None)
        self.client = EngineClient(self.url, timeout_s=max(600.0, self.s.timeout_s))
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

    CHECKS: tuple[tuple[str, str], ...] = (
        ("health_info", "health, info and metrics routes; contract version; vocabulary matches the model"),
        ("generate_fields", "completions carry token ids, log-probs, versions and finish reasons; n and seed"),
        ("logprobs_greedy", "greedy tokens and log-probs match a rescoring of the same tokens"),
        ("logprobs_sampled", "sampled log-probs are log softmax(logits / temperature) of the rescoring"),
        ("stop_and_length", "stop tokens end a completion (included); length at max_new_tokens and context"),
        ("stop_strings", "stop strings end a completion at the token that completes one (kept whole)"),
        ("queueing", "requests beyond the running limit queue and finish; none is refused"),
        ("completions", "OpenAI-style /v1/completions"),
        ("bad_input", "bad input is a 4xx whose error.field names the field; the server keeps serving"),
        ("abort", "abort one and all: finish reason abort with the tokens so far; unknown ids abort nothing"),
        ("group_init", "joining the weight-update group; an update for another group is a 409"),
        ("update_identical", "an update with the same weights keeps greedy outputs; new tokens carry its version"),
        ("update_changes", "an update with new weights changes outputs to the new model's"),
        ("in_flight_update", "an update during a long generation switches it mid-way, keeping its KV cache"),
        ("refused_update", "a mismatched update is refused naming the parameter; weights stay unchanged"),
    )
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
                    results.append(self._run_one(name, getattr(self, f"check_{name}")))
        finally:
            self._restore()
            self.client.close()
        return results

    def _run_one(self, name: str, fn: Callable[[], str | None]) -> Result:
        self.log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
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
                self._push(self.ref.base)
        except Exception as e:
            self.log(f"could not restore the original weights: {e}")
        finally:
            self.group.destroy()
            self.group = None

    # --- helpers -------------------------------------------------------------------------------------------

    def _make_prompt(self, n: int) -> list[int]:
        """n random tokens, none EOS; where --model has a tokenizer, none special and each with visible text of
        its own, so that a model that repeats its input's last token still writes text to cut with stop strings."""
        eos = set(self.info.eos_token_ids) if self.info else set()
        vocab = min(self.ref.vocab_size, self.info.vocab_size if self.info else self.ref.vocab_size)
        g = torch.Generator().manual_seed(7)
        ids = [int(t) for t in torch.randint(3, vocab, (64 * n,), generator=g) if int(t) not in eos]
        try:
            tokenizer = self._local_tokenizer()
        except Skipped:
            return ids[:n]
        special = set(tokenizer.all_special_ids)

        def visible(t: int) -> bool:
            text = tokenizer.decode([t], skip_special_tokens=True)
            return t not in special and bool(text.strip()) and "\ufffd" not in text

        shown = [t for t in ids if visible(t)]
        return shown[:n] if len(shown) >= n else ids[:n]

    def _greedy(self, max_new: int, **kw: Any) -> Completion:
        return self.client.generate(self.prompt, temperature=0, max_new_tokens=max_new, ignore_eos=True,
                                    **kw).completions[0]

    def _push(self, state: dict[str, torch.Tensor], bucket_bytes: int | None = None):
        version = self.version + 1
        bb = self.s.bucket_bytes if bucket_bytes is None else bucket_bytes
        resp = push_weights(self.group, [self.client], self.ref.named(state), version, bb)[0]
        self.version, self.state = version, state
        return resp

    def _post(self, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
        if content is not None:
            return httpx.post(f"{self.url}{path}", content=content,
                              headers={"content-type": "application/json", **self.auth},
                              timeout=60)
        return httpx.post(f"{self.url}{path}", json=body, timeout=60, headers=self.auth)

    def _per_token(self) -> float:
        """Seconds per token of one greedy sequence on this engine (measured once)."""
        if self._per_token_s is None:
            t0 = time.perf_counter()
            self._greedy(64)
            self._per_token_s = (time.perf_counter() - t0) / 64
        return self._per_token_s

    def _checksums(self) -> dict[str, str] | None:
        r = httpx.get(f"{self.url}/v1/weights/checksum", timeout=120, headers=self.auth)
        if r.status_code == 501:
            return None
        expect(r.status_code == 200, f"GET /v1/weights/checksum answered {r.status_code}: {r.text[:200]}")
        return r.json()["checksums"]

    # --- checks --------------------------------------------------------------------------------------------

    def check_health_info(self) -> str:
        r = httpx.get(f"{self.url}/v1/health", timeout=10)
        expect(r.status_code == 200 and r.json().get("status") == "ok", f"/v1/health: {r.status_code} {r.text}")
        theirs = r.json().get("contract_version", "")
        expect(theirs.split(".")[0] == CONTRACT_VERSION.split(".")[0],
               f"contract version {theirs!r}, this suite checks {CONTRACT_VERSION}")
        info = self.info
        expect(info.vocab_size == self.ref.vocab_size,
               f"info.vocab_size {info.vocab_size}, the local model has {self.ref.vocab_size}")
        expect(info.max_model_len > len(self.prompt) + 8, f"info.max_model_len {info.max_model_len} is too small")
        expect(info.max_running_seqs >= 1, "info.max_running_seqs must be at least 1")
        m = httpx.get(f"{self.url}/metrics", timeout=10, headers=self.auth)
        expect(m.status_code == 200 and "pipelinerl_weight_version" in m.text,
               "/metrics must be Prometheus text with pipelinerl_weight_version")
        self.version = info.weight_version
        return f"engine {info.engine!r}, weight version {info.weight_version}, max_model_len {info.max_model_len}"

    def check_generate_fields(self) -> str:
        rid = f"conformance-{uuid.uuid4().hex[:8]}"
        out = self.client.generate(self.prompt, request_id=rid, temperature=0, max_new_tokens=8, ignore_eos=True)
        expect(out.request_id == rid, f"request_id {out.request_id!r}, sent {rid!r}")
        expect(out.prompt_len == len(self.prompt), f"prompt_len {out.prompt_len}, prompt has {len(self.prompt)}")
        expect(len(out.completions) == 1, f"{len(out.completions)} completions for n=1")
        c = out.completions[0]
        expect(len(c.token_ids) == 8 and len(c.logprobs) == 8 and len(c.versions) == 8,
               f"lengths token_ids/logprobs/versions {len(c.token_ids)}/{len(c.logprobs)}/{len(c.versions)}, "
               "expected 8 each")
        expect(c.finish_reason == "length", f"finish_reason {c.finish_reason!r} at max_new_tokens, expected length")
        expect(set(c.versions) == {self.version}, f"versions {sorted(set(c.versions))}, weights are {self.version}")
        expect(all(lp <= 1e-6 for lp in c.logprobs), "log-probs must be <= 0")
        n = min(3, self.info.max_running_seqs)  # more samples than the running limit are refused (bad_input)
        temperature, p_same = self._spread_temperature(n)
        kw = dict(temperature=temperature, max_new_tokens=8, ignore_eos=True, n=n, seed=11)
        a = self.client.generate(self.prompt, **kw).completions
        b = self.client.generate(self.prompt, **kw).completions
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
            samples = a if i == 0 else self.client.generate(self.prompt, **{**kw, "seed": 12 + i}).completions
            if len({tuple(x.token_ids) for x in samples}) > 1:
                return f"n={n} samples at temperature {temperature:g} differ (request {i + 1})"
        raise CheckFailed(f"the n={n} samples of one prompt were all identical in {requests} requests with different "
                          f"seeds at temperature {temperature:g}; independent samples are with probability at most "
                          f"{p_same:.3g} each time")

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

    def check_logprobs_greedy(self) -> str:
        c = self._greedy(24)
        problem = mismatch(c, self.ref.logits(self.state, self.prompt, c.token_ids), 0, self.s.atol)
        expect(problem is None, f"greedy: {problem}")
        return f"24 tokens within atol {self.s.atol:g}"

    def check_logprobs_sampled(self) -> str:
        out = self.client.generate(self.prompt, temperature=0.7, max_new_tokens=16, n=2, seed=5, ignore_eos=True)
        for i, c in enumerate(out.completions):
            problem = mismatch(c, self.ref.logits(self.state, self.prompt, c.token_ids), 0.7, self.s.atol)
            expect(problem is None, f"sample {i} at temperature 0.7: {problem}")
        return "2 x 16 tokens at temperature 0.7"

    def check_stop_and_length(self) -> str:
        greedy = self._greedy(10)
        stop_at = greedy.token_ids[3]
        k = greedy.token_ids.index(stop_at)
        out = self._greedy(10, stop_token_ids=[stop_at])
        expect(out.finish_reason == "stop", f"finish_reason {out.finish_reason!r} at a stop token, expected stop")
        expect(out.token_ids == greedy.token_ids[:k + 1],
               f"tokens {out.token_ids}, expected the greedy ones up to and including the stop token "
               f"{greedy.token_ids[:k + 1]}")
        room = 5
        long_prompt = (self.prompt * (self.info.max_model_len // len(self.prompt) + 1))[:self.info.max_model_len - room]
        c = self.client.generate(long_prompt, temperature=0, max_new_tokens=room + 50,
                                 ignore_eos=True).completions[0]
        expect(c.finish_reason == "length" and len(c.token_ids) == room,
               f"at the end of the context: {len(c.token_ids)} tokens, finish {c.finish_reason!r}; expected {room}, "
               "length")
        return ""

    def _local_tokenizer(self):
        """The tokenizer of --model, which decodes as the contract defines stop strings."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as e:
                raise Skipped(f"--model has no tokenizer to decode with ({type(e).__name__}: {e})") from None
        return self._tokenizer

    def check_stop_strings(self) -> str:
        from pipelinerl.engines.stops import decoder, stop_position

        tokenizer = self._local_tokenizer()
        n = 32
        greedy = self._greedy(n)
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
            out = self._greedy(n, stop=[never, stop])
        except EngineError as e:
            if e.status == 400 and _norm_field(e.field) == "sampling.stop" and "tokenizer" in e.message:
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
        expect(diff <= self.s.atol, f"{where}: log-probs differ from the greedy run's by {diff:.2e}")
        last = self._greedy(cut + 1, stop=[stop])
        expect(last.token_ids == want and last.finish_reason == "stop",
               f"{where} completed by the last allowed token (max_new_tokens {cut + 1}): finish "
               f"{last.finish_reason!r}, {len(last.token_ids)} tokens; expected stop, {cut + 1}")
        none = self._greedy(n, stop=[never])
        expect(none.token_ids == ids and none.finish_reason == "length",
               f"a stop string that is not generated changed the output: {len(none.token_ids)} tokens, finish "
               f"{none.finish_reason!r}")
        return f"{where}; {self._completions_stop()}"

    def _completions_stop(self) -> str:
        """`/v1/completions` with an OpenAI-style stop string: the text ends at the end of the stop string."""
        body = {"prompt": "1+1=", "max_tokens": 24, "temperature": 0}
        r = self._post("/v1/completions", body)
        if r.status_code == 400 and (_error_of(r) or {}).get("field") == "prompt":
            return "/v1/completions: no tokenizer"
        expect(r.status_code == 200, f"/v1/completions answered {r.status_code}: {r.text[:300]}")
        text = r.json()["choices"][0]["text"]
        start = len(text) // 2
        stop = text[start:start + 3]
        if len(text) < 6 or not stop.strip():
            return f"/v1/completions: text {text!r} too short to cut"
        r = self._post("/v1/completions", {**body, "stop": stop})
        expect(r.status_code == 200, f"/v1/completions with stop {stop!r} answered {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        want = text[:text.find(stop) + len(stop)]
        expect(choice["text"] == want and choice["finish_reason"] == "stop",
               f"/v1/completions with stop {stop!r}: text {choice['text']!r}, finish {choice['finish_reason']!r}; "
               f"expected {want!r} (the text without stop: {text!r}), stop")
        return f"/v1/completions text cut after {stop!r}"

    def check_queueing(self) -> str:
        n = min(self.info.max_running_seqs + 8, 264)
        with ThreadPoolExecutor(n) as pool, httpx.Client(base_url=self.url, timeout=600, headers=self.auth,
                                                         limits=httpx.Limits(max_connections=n + 8)) as http:
            def one(i: int) -> httpx.Response:
                body = {"prompt_token_ids": self.prompt[: 2 + i % 4],
                        "sampling": {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": i}}
                return http.post("/v1/generate", json=body)

            responses = list(pool.map(one, range(n)))
        bad = [r for r in responses if r.status_code != 200]
        expect(not bad, f"{len(bad)} of {n} concurrent requests failed, e.g. {bad[0].status_code}: "
                        f"{bad[0].text[:200]}" if bad else "")
        lengths = {len(r.json()["completions"][0]["token_ids"]) for r in responses}
        expect(lengths == {4}, f"completion lengths {sorted(lengths)}, expected 4")
        return f"{n} concurrent requests, running limit {self.info.max_running_seqs}"

    def check_completions(self) -> str:
        r = self._post("/v1/completions", {"prompt": ["1+1=", "2+2="], "max_tokens": 5, "temperature": 0,
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

    def bad_inputs(self) -> list[tuple[dict, str | tuple[str, ...]]]:
        """(body, the field its error must name: one, or a tuple of names any of which will do)."""
        info, p = self.info, self.prompt[:1]
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

    def check_bad_input(self) -> str:
        failures = []
        for body, want in self.bad_inputs():
            r = self._post("/v1/generate", body)
            err = _error_of(r)
            if not 400 <= r.status_code < 500 or err is None:
                failures.append(f"{_short(body)}: {r.status_code} {r.text[:120]}")
            elif (_norm_field(err.get("field")) not in {_norm_field(w) for w in (want if isinstance(want, tuple)
                                                                                 else (want,))}
                  or not err.get("message")):
                failures.append(f"{_short(body)}: error.field {err.get('field')!r}, expected {want!r}")
        r = self._post("/v1/generate", content=b"{not json")
        if r.status_code != 400 or _error_of(r) is None:
            failures.append(f"invalid JSON: {r.status_code} {r.text[:120]}")
        r = self._post("/v1/weights/update", {"version": 1, "params": []})
        if not 400 <= r.status_code < 500 or _norm_field((_error_of(r) or {}).get("field")) != "params":
            failures.append(f"update with no params: {r.status_code} {r.text[:120]}")
        expect(not failures, "; ".join(failures))
        c = self._greedy(4)
        expect(len(c.token_ids) == 4, "the engine stopped serving after bad input")
        return f"{len(self.bad_inputs()) + 2} bad requests"

    def check_abort(self) -> str:
        steps, seconds = self._long_run()
        delay = 0.25 * seconds
        attempts = 5  # on a busy machine the timing of a generation varies: retry with another delay
        for attempt in range(attempts):
            prefix = f"conformance-{uuid.uuid4().hex[:6]}-"
            ids = [prefix + k for k in "abc"]
            running = {rid: _background(lambda rid=rid: self._greedy(steps, request_id=rid)) for rid in ids}
            time.sleep(delay)
            first = self.client.abort(ids[0])
            rest = self.client.abort(None)
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
            expect(self.client.abort("conformance-no-such-request") == [],
                   "aborting an unknown id must abort nothing")
            return f"aborted after {len(a.token_ids)} of {steps} tokens (attempt {attempt + 1})"
        raise CheckFailed(f"every request finished before it could be aborted ({steps}-token generations, "
                          f"{attempts} tries)")

    def check_group_init(self) -> str:
        from pipelinerl.procs import free_port
        from pipelinerl.weight_sync import init_weight_update_group

        if self.client.info().weight_group is None:
            r = self._post("/v1/weights/update", {"version": self.version + 1, "group_name": self.s.group_name,
                                                  "params": [{"name": "x", "dtype": "float32", "shape": [1]}]})
            expect(r.status_code == 409, f"an update before joining any group answered {r.status_code}, expected 409")
        port = free_port()
        world, futures = init_group_on_engines([self.client], self.s.master_address, port, "gloo",
                                               self.s.group_name, self.s.timeout_s)
        self.group = init_weight_update_group(self.s.master_address, port, 0, world, "gloo", self.s.group_name,
                                              self.s.timeout_s)
        for f in futures:
            f.result()
        group = self.client.info().weight_group
        expect(group == self.s.group_name, f"info.weight_group {group!r} after joining {self.s.group_name!r}")
        r = self._post("/v1/weights/update", {"version": self.version + 1, "group_name": "not-" + self.s.group_name,
                                              "params": [{"name": "x", "dtype": "float32", "shape": [1]}]})
        expect(r.status_code == 409 and _norm_field((_error_of(r) or {}).get("field")) == "group_name",
               f"an update for a group the engine is not in answered {r.status_code}: {r.text[:200]}")
        return f"gloo group {self.s.group_name!r}, world size {world}"

    def check_update_identical(self) -> str:
        self._push(self.ref.base)
        before = self._greedy(24)
        sizes = sorted({self.s.bucket_bytes, 4096 if self.s.bucket_bytes == 0 else 0})
        for bb in sizes:
            resp = self._push(self.ref.base, bucket_bytes=bb)
            expect(resp.version == self.version and resp.received_bytes > 0,
                   f"update response {resp.model_dump()} for version {self.version}")
            after = self._greedy(24)
            expect(after.token_ids == before.token_ids,
                   f"bucket_bytes={bb}: greedy output changed after an update with the same weights")
            expect(set(after.versions) == {self.version},
                   f"bucket_bytes={bb}: versions {sorted(set(after.versions))}, expected {self.version}")
        return f"bucket_bytes {sizes}"

    def _separating_weights(self, seed: int) -> tuple[str, dict[str, torch.Tensor]]:
        """New weights (and what they are) under which the greedy first token after the prompt provably changes:
        no token within 2 x atol of the best one under the current weights is within 2 x atol of the best one
        under the new (by this model's rescoring), so no engine that passes the log-prob checks can give the same
        first token under both."""
        margin = 2 * self.s.atol
        old = torch.log_softmax(self.ref.next_logits(self.state, self.prompt), -1)
        old_best = set(torch.nonzero(old >= old.max() - margin)[:, 0].tolist())
        for what, state in self.ref.changed(seed):
            new = torch.log_softmax(self.ref.next_logits(state, self.prompt), -1)
            if not old_best & set(torch.nonzero(new >= new.max() - margin)[:, 0].tolist()):
                return what, state
        raise Skipped("no weights found that change the greedy first token of this model (its next-token "
                      f"log-probs after the prompt are flat within {margin:g})")

    def check_update_changes(self) -> str:
        before = self._greedy(24)
        what, new = self._separating_weights(seed=1)
        resp = self._push(new)
        expect(resp.version == self.version, f"update answered version {resp.version}, sent {self.version}")
        info = self.client.info()
        expect(info.weight_version == self.version, f"info.weight_version {info.weight_version} after the update "
                                                    f"to {self.version}")
        c = self._greedy(24)
        expect(c.token_ids != before.token_ids, "greedy output did not change after new weights")
        expect(set(c.versions) == {self.version}, f"versions {sorted(set(c.versions))}, expected {self.version}")
        problem = mismatch(c, self.ref.logits(new, self.prompt, c.token_ids), 0, self.s.atol)
        expect(problem is None, f"after the update: {problem}")
        sums = self._checksums()
        if sums is None:
            return f"checksum route not implemented (501); outputs compared instead ({what})"
        from pipelinerl.engines.embedded.engine import tensor_checksums

        local = tensor_checksums(dict(self.ref.named(new)))
        if not set(local) <= set(sums):
            return f"checksums use other parameter names than the model's; outputs compared instead ({what})"
        wrong = [n for n, h in local.items() if sums[n] != h]
        expect(not wrong, f"checksums differ from the pushed weights for {wrong[:3]}")
        return f"outputs and checksums match the pushed weights ({what})"

    def _long_run(self) -> tuple[int, float]:
        """(tokens, seconds) of a long greedy generation on this engine, measured once: the in-flight and abort
        checks time their interventions from it (there is no engine-neutral way to watch a request's
        progress)."""
        if self._long is None:
            room = self.info.max_model_len - len(self.prompt) - 1
            if room < 32:
                raise Skipped(f"max_model_len {self.info.max_model_len} leaves no room for a long generation")
            steps = max(32, min(int(self.s.in_flight_seconds / max(self._per_token(), 1e-5)), 1000, room))
            t0 = time.perf_counter()
            c = self._greedy(steps)
            expect(len(c.token_ids) == steps, f"a {steps}-token generation returned {len(c.token_ids)} tokens")
            self._long = (steps, time.perf_counter() - t0)
        return self._long

    def check_in_flight_update(self) -> str:
        if self.state is not self.ref.base:
            self._push(self.ref.base)
        old = self.ref.base
        candidates = self.ref.changed(seed=2)
        what, new = candidates.pop(0)
        steps, seconds = self._long_run()
        delay = 0.35 * seconds
        landed: list[int] = []
        timing_tries = 5  # on a busy machine the timing of a generation varies: retry with another delay
        while timing_tries > 0:
            old_version = self.version
            thread, result = _background(lambda: self._greedy(steps))
            time.sleep(delay)
            self._push(new)
            thread.join(600)
            c = result.get("out")
            expect(isinstance(c, Completion), f"the long generation failed: {c!r}")
            expect(len(c.token_ids) == steps, f"{len(c.token_ids)} tokens, expected {steps}")
            new_version = self.version
            switch = c.versions.index(new_version) if new_version in c.versions else steps
            landed.append(switch)
            if not 0 < switch < steps - 10:  # the update landed before or after the generation: time it again
                delay = delay * (2.0 if switch == 0 else 0.4)
                timing_tries -= 1
                self._push(self.ref.base)
                continue
            expect(c.versions == [old_version] * switch + [new_version] * (steps - switch),
                   f"versions change more than once or to other values: {_runs(c.versions)}")
            problem = mismatch(c, self.ref.logits_switched(old, new, self.prompt, c.token_ids, switch), 0,
                               self.s.atol)
            expect(problem is None, f"switch at token {switch}: {problem} (expected: old weights before the switch, "
                                    "new weights after it, attending to the KV cache computed before it)")
            self._push(self.ref.base)  # the original weights back after every try
            tail = Completion(token_ids=c.token_ids[switch:], logprobs=c.logprobs[switch:],
                              versions=c.versions[switch:], finish_reason=c.finish_reason)
            if mismatch(tail, self.ref.logits(old, self.prompt, c.token_ids)[switch:], 0, 2 * self.s.atol) is not None:
                return f"switched at token {switch} of {steps} (tries landed at {landed}; new weights: {what})"
            # The old weights give these tokens and log-probs too: this update cannot tell whether the engine
            # switched (an engine that kept the old weights would pass). Weights that change more, if any.
            if not candidates:
                raise Skipped(f"no weights found whose tokens after a switch differ from the old weights' (last: "
                              f"{what}): the model's next-token log-probs are flat")
            what, new = candidates.pop(0)
        raise CheckFailed(f"could not land an update inside a {steps}-token generation: tries landed at {landed}")

    def check_refused_update(self) -> str:
        if self.state is not self.ref.base:
            self._push(self.ref.base)
        sums_before = self._checksums()
        before = self._greedy(24)
        named = self.ref.named(self.ref.perturbed(seed=3))
        bad = min(3, len(named) - 1)
        name, t = named[bad]
        named[bad] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))
        cases = [(named, f"params[{bad}].shape", name),
                 (self.ref.named(self.ref.base) + [("conformance.not_a_parameter", torch.zeros(2))],
                  f"params[{len(named)}].name", "conformance.not_a_parameter"),
                 ([(self.ref.named(self.ref.base)[0][0], self.ref.named(self.ref.base)[0][1].to(torch.float16))],
                  "params[0].dtype", self.ref.named(self.ref.base)[0][0])]
        for tensors, want_field, want_name in cases:
            try:
                push_weights(self.group, [self.client], tensors, self.version + 1, self.s.bucket_bytes)
            except EngineError as e:
                expect(e.status == 400, f"mismatched update ({want_field}) answered {e.status}, expected 400")
                expect(_norm_field(e.field) == _norm_field(want_field),
                       f"mismatched update: error.field {e.field!r}, expected {want_field!r}")
                expect(want_name in e.message, f"the refusal does not name {want_name!r}: {e.message}")
            else:
                raise CheckFailed(f"a mismatched update ({want_field}) was accepted")
        if sums_before is not None:
            expect(self._checksums() == sums_before, "checksums changed after refused updates")
        after = self._greedy(24)
        expect(after.token_ids == before.token_ids and
               max((abs(x - y) for x, y in zip(after.logprobs, before.logprobs)), default=0.0) < 1e-4,
               "greedy output or log-probs changed after refused updates")
        resp = self._push(self.ref.base)
        expect(resp.version == self.version, "a valid update after refused ones failed")
        return "weights unchanged (" + ("checksums" if sums_before is not None else "identical greedy output") + ")"


def _background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` on a thread; its result (or exception) lands in the dict under "out"."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["out"] = fn()
        except Exception as e:
            result["out"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


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


def _error_of(r: httpx.Response) -> dict | None:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def _norm_field(f: str | None) -> str | None:
    """`prompt_token_ids.1` (pydantic's location) and `prompt_token_ids[1]` name the same field."""
    return re.sub(r"\.(\d+)", r"[\1]", f) if f else f


def _short(body: dict) -> str:
    text = json.dumps(body)
    return text if len(text) < 80 else text[:77] + "..."


def _runs(versions: Sequence[int]) -> str:
    out, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            out.append(f"{versions[start]}x{i - start}")
            start = i
    return ", ".join(out)


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
