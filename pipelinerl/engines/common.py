"""What every engine behind the contract shares (the embedded engine and the vLLM and SGLang fronts): the
model's facts read without loading its weights, the contract's input and update checks, per-token versions from
version spans, OpenAI-style completions on top of `generate`, and a front's own metrics.

The fronts validate requests themselves instead of relaying the engine's errors, so that a bad request gets the
contract's 4xx with `error.field` whatever engine is behind, with the same messages as the embedded engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.contracts.inference import (
    CompletionsChoice,
    CompletionsChoiceLogprobs,
    CompletionsRequest,
    CompletionsResponse,
    CompletionsUsage,
    GenerateRequest,
    GenerateResponse,
    ParamSpec,
    SamplingParams,
)
from pipelinerl.contracts.routes import ContractError, render_metrics
from pipelinerl.engines.stops import text_through_stop


@dataclass
class ModelFacts:
    """What a front needs to know about the served model: vocabulary, EOS ids, and every parameter's name,
    dtype and shape (tied parameters under both names) to check updates against."""

    vocab_size: int
    eos_token_ids: list[int]
    params: dict[str, tuple[str, list[int]]]
    tied_embeddings: bool
    max_positions: int | None


def model_facts(path: str, dtype: str) -> ModelFacts:
    """Read from the model's config, building the model on the meta device (no weights are loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {n: (dtype, list(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)}
    eos: set[int] = set()
    sources: list = [config]
    try:
        sources.append(GenerationConfig.from_pretrained(path))
    except (OSError, ValueError):
        pass
    for source in sources:
        ids = getattr(source, "eos_token_id", None)
        if ids is not None:
            eos |= set(ids) if isinstance(ids, list) else {int(ids)}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelFacts(vocab_size=model.get_input_embeddings().num_embeddings, eos_token_ids=sorted(eos),
                      params=params, tied_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
                      max_positions=getattr(text_config, "max_position_embeddings", None))


def load_tokenizer(path: str):
    """The model's tokenizer, or None for a bare model directory (/v1/generate still works on token ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:
        return None


def check_generate(req: GenerateRequest, vocab_size: int, max_model_len: int, max_running_seqs: int,
                   tokenizer) -> int:
    """Raise the contract's 400 for a request the engine cannot serve; return the tokens it may generate.
    `tokenizer`: the front's (None: stop strings cannot be matched, nor checked)."""
    prompt, params = req.prompt_token_ids, req.sampling
    if params.stop and tokenizer is None:
        raise ContractError(400, "sampling.stop: this engine has no tokenizer to match stop strings with; use "
                                 "sampling.stop_token_ids", "sampling.stop")
    if len(prompt) >= max_model_len:
        raise ContractError(400, f"prompt_token_ids: {len(prompt)} tokens leave no room to generate within the "
                                 f"context of {max_model_len}", "prompt_token_ids")
    for name, ids in (("prompt_token_ids", prompt), ("sampling.stop_token_ids", params.stop_token_ids)):
        bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
        if bad is not None:
            raise ContractError(400, f"{name}[{bad}]: token id {ids[bad]} is outside the vocabulary "
                                     f"(size {vocab_size})", f"{name}[{bad}]")
    if params.n > max_running_seqs:
        raise ContractError(400, f"sampling.n: {params.n} samples exceed max_running_seqs {max_running_seqs}",
                            "sampling.n")
    return min(params.max_new_tokens, max_model_len - len(prompt))


def effective_top_k(top_k: int, vocab_size: int) -> int:
    """The contract's top_k as an engine applies it: 0 (off) for 0 and for any value of the vocabulary's size or
    more, which keep every token alike (the engines' samplers hold top_k in int32 and some bound it by the
    vocabulary)."""
    return 0 if top_k >= vocab_size else top_k


def check_update(params: Sequence[ParamSpec], model: dict[str, tuple[str, list[int]]]) -> tuple[str, str] | None:
    """(field, message) of the first mismatch between an update and the model, or None (as the embedded
    engine words it)."""
    seen: set[str] = set()
    for i, p in enumerate(params):
        where = f"params[{i}]"
        if p.name in seen:
            return f"{where}.name", f"{where}: parameter {p.name!r} appears twice in the update"
        seen.add(p.name)
        target = model.get(p.name)
        if target is None:
            return f"{where}.name", f"{where}: {p.name!r} is not a parameter of the model"
        dtype, shape = target
        if shape != p.shape:
            return f"{where}.shape", f"{where}: {p.name!r} has shape {shape} in the model, the update says {p.shape}"
        if dtype != p.dtype:
            return f"{where}.dtype", f"{where}: {p.name!r} is {dtype} in the model, the update says {p.dtype}"
    return None


def versions_from_spans(spans: Sequence[tuple[int, int, int]] | None, n_tokens: int, fallback: int) -> list[int]:
    """Per-token versions from (version, start, end) spans over output-token indexes; a token no span covers
    gets the version of the token before it (`fallback` for the first)."""
    out: list[int | None] = [None] * n_tokens
    for version, start, end in spans or ():
        for i in range(max(0, start), min(end, n_tokens)):
            out[i] = version
    previous = fallback
    for i, v in enumerate(out):
        previous = out[i] = previous if v is None else v
    return out  # type: ignore[return-value]


class GeneratedTextTokenizer:
    """A tokenizer as /v1/completions uses it (encode the prompts, decode and name the generated tokens), safe for
    every id the model can generate. A model's embedding may have more rows than its tokenizer has tokens
    (Qwen2.5's 152064 rows, 151665 tokens), and a sampled id past the tokenizer's has no string: transformers
    names it None, which the response cannot carry, and a slow tokenizer's decode raises on it. Such an id reads
    as "" in `logprobs.tokens` and adds nothing to the text, as a fast tokenizer's decode already treats it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._size = len(tokenizer)  # ids 0 .. size - 1 are the tokenizer's, added tokens included

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's own text, as OpenAI and vLLM put it in `logprobs.tokens`: " the", not the vocabulary's
        byte-level name "Ġthe" (special tokens keep their names; a byte of a multi-byte character alone reads as
        "\ufffd"); "" for an id with no string."""
        return [self._tokenizer.decode([i]) if name is not None else "" for i, name in zip(ids, self._names(ids))]

    def decode(self, ids: list[int], **kwargs) -> str:
        return self._tokenizer.decode([i for i, name in zip(ids, self._names(ids)) if name is not None], **kwargs)

    def _names(self, ids: list[int]) -> list[str | None]:
        """Each id's token string, None where the tokenizer has none (past its ids, or a gap in them)."""
        names = iter(self._tokenizer.convert_ids_to_tokens([i for i in ids if 0 <= i < self._size]))
        return [next(names) if 0 <= i < self._size else None for i in ids]


async def completions_via_generate(req: CompletionsRequest, tokenizer, model_name: str,
                                   generate: Callable[[GenerateRequest], Awaitable[GenerateResponse]]
                                   ) -> CompletionsResponse:
    """OpenAI-style text completions served through the contract's `generate` (tokenize, generate, decode). The
    tokens are the contract's (a stop string's last token kept whole); the text is cut at the stop string's end."""
    import asyncio

    if tokenizer is None:
        raise ContractError(400, "this engine has no tokenizer; use /v1/generate with token ids", "prompt")
    tokenizer = GeneratedTextTokenizer(tokenizer)
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not prompts:
        raise ContractError(400, "prompt: must not be empty", "prompt")
    params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            max_new_tokens=req.max_tokens, n=req.n, seed=req.seed, stop_token_ids=req.stop_token_ids,
                            stop=req.stop)
    encoded = [tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ContractError(400, f"prompt[{i}]: encodes to no tokens", f"prompt[{i}]")
    results = await asyncio.gather(*(generate(GenerateRequest(prompt_token_ids=ids, sampling=params))
                                     for ids in encoded))
    choices, completion_tokens = [], 0
    for res in results:
        for c in res.completions:
            lp = None
            if req.logprobs is not None:
                lp = CompletionsChoiceLogprobs(tokens=tokenizer.token_texts(c.token_ids),
                                               token_logprobs=c.logprobs)
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if c.finish_reason == "stop" and req.stop:  # the text ends where the stop string does
                text = text_through_stop(text, req.stop)
            choices.append(CompletionsChoice(index=len(choices), finish_reason=c.finish_reason, logprobs=lp,
                                             text=text))
            completion_tokens += len(c.token_ids)
    prompt_tokens = sum(len(e) for e in encoded)
    return CompletionsResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                               model=req.model or model_name, choices=choices,
                               usage=CompletionsUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                                      total_tokens=prompt_tokens + completion_tokens))


@dataclass
class FrontMetrics:
    """Counters a front keeps itself, exported under the contract's metric names. Tokens are counted when a
    request returns; tokens/s is over the wall time during which at least one request was in flight."""

    running: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    busy_seconds: float = 0.0
    updates: int = 0
    refused_updates: int = 0
    update_bytes: int = 0
    update_receive_seconds: float = 0.0
    update_switch_seconds: float = 0.0
    last_update_bytes: int = 0
    last_update_receive_seconds: float = 0.0
    last_update_switch_seconds: float = 0.0
    _busy_since: float | None = field(default=None, repr=False)

    def request_started(self) -> None:
        if self.running == 0:
            self._busy_since = time.monotonic()
        self.running += 1

    def request_ended(self, tokens: int) -> None:
        self.running -= 1
        self.generated_tokens += tokens
        self.requests_finished += 1
        if self.running == 0 and self._busy_since is not None:
            self.busy_seconds += time.monotonic() - self._busy_since
            self._busy_since = None

    def update_done(self, nbytes: int, receive_s: float, switch_s: float) -> None:
        self.updates += 1
        self.update_bytes += nbytes
        self.update_receive_seconds += receive_s
        self.update_switch_seconds += switch_s
        self.last_update_bytes, self.last_update_receive_seconds = nbytes, receive_s
        self.last_update_switch_seconds = switch_s

    def text(self, version: int) -> str:
        busy = self.busy_seconds + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
        rows = [
            ("running_seqs", "gauge", self.running, "requests in flight through this front"),
            ("waiting_requests", "gauge", 0, "not visible to the front: queued requests count as running"),
            ("weight_version", "gauge", version, "current weight version"),
            ("generated_tokens_total", "counter", self.generated_tokens, "tokens of finished requests"),
            ("tokens_per_second", "gauge", self.generated_tokens / max(busy, 1e-9),
             "generated tokens per second of wall time with requests in flight"),
            ("requests_finished_total", "counter", self.requests_finished, "requests completed"),
            ("weight_updates_total", "counter", self.updates, "weight updates applied"),
            ("weight_updates_refused_total", "counter", self.refused_updates, "mismatched updates refused"),
            ("weight_update_bytes_total", "counter", self.update_bytes, "bytes received by updates"),
            ("weight_update_receive_seconds_total", "counter", self.update_receive_seconds, "time receiving"),
            ("weight_update_switch_seconds_total", "counter", self.update_switch_seconds,
             "generation paused to switch weights"),
            ("last_weight_update_bytes", "gauge", self.last_update_bytes, "bytes of the last update"),
            ("last_weight_update_receive_seconds", "gauge", self.last_update_receive_seconds,
             "seconds receiving the last update"),
            ("last_weight_update_switch_seconds", "gauge", self.last_update_switch_seconds,
             "generation pause for the last update"),
        ]
        return render_metrics(rows)


def json_body(resp) -> Any:
    """An engine's response body: JSON when it parses, else the text."""
    try:
        return resp.json()
    except ValueError:
        return resp.text


def param_nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    for s in shape:
        n *= s
    return n


def repo_root() -> Path:
    """The directory holding the `pipelinerl` package, for a child process's PYTHONPATH (the package may
    be used from a checkout rather than installed)."""
    return Path(__file__).resolve().parents[2]


def wait_server_healthy(name: str, url: str, proc, timeout_s: float, poll_s: float = 0.5,
                        uds: str | None = None) -> None:
    """Poll `url/health` of an engine server we started (over the unix socket `uds` when given); exit with a clear
    message if it dies or stays down."""
    import httpx

    deadline = time.monotonic() + timeout_s
    where = f"unix:{uds}" if uds else url
    with httpx.Client(transport=httpx.HTTPTransport(uds=uds) if uds else None, timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the {name} server exited with code {proc.returncode} before it was healthy")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the {name} server at {where} was not healthy after {timeout_s:g}s "
                                 "(--start-timeout-s, config engine.start_timeout_s)")
            time.sleep(poll_s)
