"""The contract served over a running SGLang server, through SGLang's own endpoints (no code inside SGLang).

Targets SGLang's HTTP API as of 0.5.x (the `sglang>=0.5.4` extra): `/generate` with `input_ids` and
`return_logprob`, `/abort_request`, `/init_weights_update_group`, `/update_weights_from_distributed`,
`/pause_generation` with `mode: in_place` and `/continue_generation`. Written from SGLang's documented API and
not run here (SGLang has no CPU build on PyPI); see contracts/conformance/README.md for what was run.

Where it differs from the contract, because SGLang's endpoints do not allow more:
- The update pauses generation (`in_place`: running requests keep their KV cache) for the whole broadcast, not
  only for the switch: SGLang receives inside its scheduler loop.
- Only `bucket_bytes = 0` (one broadcast per tensor), the format SGLang receives.
- A mismatched update is refused (400, naming the parameter) without draining the broadcast: SGLang cannot be
  told to receive and discard, so the trainer's broadcast for it times out.
- Per-token versions come from `meta_info.weight_versions` spans when the server reports them; otherwise every
  token of a request carries `meta_info.weight_version` (exact only for requests no update overlapped).
- `n > 1` is sent as n requests (seeds seed, seed+1, ...), so samples of one prompt do not share its prefill.
- Stop strings go to SGLang as `stop` with `no_stop_trim`; SGLang matches them in a window of the stop string's
  own token count + 1 decoded with special tokens, and finishes with `length` when the last allowed token
  completes one, so the front enforces the contract's definition on what comes back (`stops.apply_stop`): tokens
  after the one that completed a stop string are dropped, and that completion ends with `stop`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from pipelinerl.contracts.inference import (
    Completion,
    CompletionsRequest,
    CompletionsResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    InitWeightUpdateGroupRequest,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsChecksumResponse,
)
from pipelinerl.engines.common import (
    FrontMetrics,
    ModelFacts,
    check_generate,
    check_update,
    completions_via_generate,
    json_body,
    param_nbytes,
    versions_from_spans,
)
from pipelinerl.engines.server import ContractError
from pipelinerl.engines.stops import apply_stop


@dataclass
class SGLangSettings:
    max_model_len: int
    max_running_seqs: int
    initial_version: int = 0


class SGLangBackend:
    """Implements `pipelinerl.engines.server.EngineBackend` over SGLang's native HTTP API at `url`."""

    def __init__(self, url: str, model_name: str, facts: ModelFacts, settings: SGLangSettings, tokenizer=None):
        self.url, self.model_name, self.facts, self.settings = url.rstrip("/"), model_name, facts, settings
        self.tokenizer = tokenizer
        self.version = settings.initial_version
        self.metrics = FrontMetrics()
        self._group_name: str | None = None
        self._update_lock = asyncio.Lock()
        self._in_flight: dict[str, list[str]] = {}  # contract request id -> SGLang rids
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            self._http = httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        s = self.settings
        max_new = check_generate(req, self.facts.vocab_size, s.max_model_len, s.max_running_seqs, self.tokenizer)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._in_flight:
            raise ContractError(409, f"request_id {rid!r} is already running", "request_id")
        p = req.sampling
        rids = [f"{rid}-{i}" for i in range(p.n)]
        self._in_flight[rid] = rids
        self.metrics.request_started()
        start_version, tokens = self.version, 0
        try:
            bodies = [{"rid": r, "input_ids": req.prompt_token_ids, "return_logprob": True,
                       "sampling_params": self._sampling_params(p, max_new, i)} for i, r in enumerate(rids)]
            responses = await asyncio.gather(*(self.http.post("/generate", json=b) for b in bodies))
            completions = [self._completion(r, start_version) for r in responses]
            if p.stop:
                completions = [apply_stop(c, self.tokenizer, p.stop) for c in completions]
            tokens = sum(len(c.token_ids) for c in completions)
            return GenerateResponse(request_id=rid, prompt_len=len(req.prompt_token_ids), completions=completions)
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(rid))
            raise
        finally:
            self._in_flight.pop(rid, None)
            self.metrics.request_ended(tokens)

    @staticmethod
    def _sampling_params(p: SamplingParams, max_new: int, sample: int) -> dict[str, Any]:
        """SGLang's `sampling_params` for sample `sample` of a request (sglang/srt/sampling/sampling_params.py)."""
        out: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
                               "max_new_tokens": max_new, "stop_token_ids": p.stop_token_ids,
                               "ignore_eos": p.ignore_eos}
        if p.seed is not None:
            out["sampling_seed"] = p.seed + sample
        if p.stop:
            # no_stop_trim: the text keeps the stop string (the tokens are never trimmed); skip_special_tokens is
            # SGLang's default, stated because the contract decodes that way
            out.update(stop=p.stop, no_stop_trim=True, skip_special_tokens=True)
        return out

    def _completion(self, resp: httpx.Response, start_version: int) -> Completion:
        body = json_body(resp)
        if resp.status_code >= 400:
            raise _error(resp.status_code, body)
        meta = body.get("meta_info", {})
        pairs = meta.get("output_token_logprobs") or []
        token_ids = [int(t[1]) for t in pairs] or list(body.get("output_ids") or [])
        logprobs = [float(t[0]) for t in pairs]
        if len(logprobs) != len(token_ids):
            raise ContractError(500, "SGLang returned no log-prob for some tokens", type="engine_error")
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        reason = {"stop": "stop", "length": "length"}.get(reason, "abort")
        spans = [_span(s) for s in meta.get("weight_versions") or []]
        spans = [s for s in spans if s is not None]
        fallback = int(meta["weight_version"]) if str(meta.get("weight_version", "")).isdigit() else start_version
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                          versions=versions_from_spans(spans, len(token_ids), fallback))

    async def completions(self, req: CompletionsRequest) -> CompletionsResponse:
        return await completions_via_generate(req, self.tokenizer, self.model_name, self.generate)

    async def abort(self, request_id: str | None) -> list[str]:
        targets = list(self._in_flight) if request_id is None else (
            [request_id] if request_id in self._in_flight else [])
        for rid in targets:
            for r in self._in_flight.get(rid, []):
                await self.http.post("/abort_request", json={"rid": r})
        return targets

    async def init_weight_update_group(self, req: InitWeightUpdateGroupRequest) -> None:
        async with self._update_lock:
            body = {"master_address": req.master_address, "master_port": req.master_port,
                    "rank_offset": req.rank_offset, "world_size": req.world_size, "group_name": req.group_name,
                    "backend": req.backend}
            result = await self._post("/init_weights_update_group", body)
            if isinstance(result, dict) and result.get("success") is False:
                raise ContractError(504, f"SGLang could not join the group: {result.get('message')}",
                                    type="weight_sync_error")
            self._group_name = req.group_name

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        async with self._update_lock:
            if self._group_name != req.group_name:
                raise ContractError(409, f"not in weight-update group {req.group_name!r}; call "
                                         "/v1/weights/init_group first", "group_name", "conflict")
            if req.bucket_bytes:
                raise ContractError(400, "SGLang receives one broadcast per tensor: use bucket_bytes 0",
                                    "bucket_bytes")
            problem = check_update(req.params, self.facts.params)
            if problem is not None:
                self.metrics.refused_updates += 1
                raise ContractError(400, problem[1], problem[0], "mismatched_update")
            t0 = time.perf_counter()
            await self._post("/pause_generation", {"mode": "in_place"})
            try:
                result = await self._post("/update_weights_from_distributed", {
                    "names": [p.name for p in req.params], "dtypes": [p.dtype for p in req.params],
                    "shapes": [p.shape for p in req.params], "group_name": req.group_name,
                    "flush_cache": False, "weight_version": str(req.version)})
            finally:
                await self._post("/continue_generation", {})
            if isinstance(result, dict) and result.get("success") is False:
                raise ContractError(500, f"SGLang failed the update: {result.get('message')}", type="engine_error")
            seconds = time.perf_counter() - t0
            self.version = req.version
            nbytes = sum(param_nbytes(p.dtype, p.shape) for p in req.params)
            self.metrics.update_done(nbytes, seconds, seconds)
            return UpdateWeightsResponse(version=req.version, received_bytes=nbytes, receive_s=seconds,
                                         switch_s=seconds)

    async def weights_checksum(self) -> WeightsChecksumResponse:
        raise ContractError(501, "SGLang exposes no per-parameter checksums", type="not_implemented")

    def info(self) -> InfoResponse:
        s = self.settings
        return InfoResponse(engine="sglang", model=self.model_name, weight_version=self.version,
                            max_model_len=s.max_model_len, vocab_size=self.facts.vocab_size,
                            max_running_seqs=s.max_running_seqs, eos_token_ids=self.facts.eos_token_ids,
                            weight_group=self._group_name)

    def metrics_text(self) -> str:
        return self.metrics.text(self.version)

    async def _post(self, path: str, body: Any) -> Any:
        resp = await self.http.post(path, json=body)
        data = json_body(resp)
        if resp.status_code >= 400:
            raise _error(resp.status_code, data, f"SGLang {path}")
        return data


def _span(s: Any) -> tuple[int, int, int] | None:
    """A (version, start, end) span from SGLang's `weight_versions` entry (a dict or a 3-list)."""
    v, start, end = (s.get("version"), s.get("start"), s.get("end")) if isinstance(s, dict) else (
        tuple(s) if isinstance(s, list | tuple) and len(s) == 3 else (None, None, None))
    if str(v).isdigit() and start is not None and end is not None:
        return int(v), int(start), int(end)
    return None



def _error(status: int, body: Any, what: str = "SGLang") -> ContractError:
    message = body.get("message") or body.get("error") or str(body) if isinstance(body, dict) else str(body)
    if 400 <= status < 500:
        return ContractError(400, f"{what}: {message}")
    return ContractError(500, f"{what} answered {status}: {message}", type="engine_error")

