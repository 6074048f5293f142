"""The contract served over a running SGLang server, through SGLang's own endpoints (no code inside SGLang).

Targets SGLang's HTTP API from 0.5.6 (the `sglang>=0.5.6` extra) to 0.5.23, read in SGLang's source of 0.5.4,
0.5.5(.post3), 0.5.6, 0.5.12 and 0.5.23: `/generate` with `input_ids` and `return_logprob`, `/abort_request`,
`/init_weights_update_group` and `/destroy_weights_update_group`, `/update_weights_from_distributed`,
`/update_weight_version`, `/pause_generation` with `mode: in_place` and `/continue_generation`, and
`/server_info` (`/get_server_info` before 0.5.6) for the version and the tensor-parallel size. SGLang itself
was not run here (it has no CPU build on PyPI): this front is tested against a stand-in server that plays
SGLang's API and joins the weight-update group as SGLang does (tests/helpers/sglang_standin.py); see
contracts/conformance/README.md for what was run.

Why not older releases: before 0.5.6 `/pause_generation` takes no mode and aborts every running request (they
return with finish reason `abort`), and an update without a pause waits until every running request has
finished; so every update would cut all in-flight samples short. The front refuses such a server when it
starts (`inspect_server`).

Weight updates: SGLang allocates every tensor of one `/update_weights_from_distributed` call on the GPU at
once, so one contract update is sent as consecutive calls of at most `SGLangSettings.update_chunk_bytes` each
(a larger tensor is a call of its own), the parameters in the update's order: the trainer broadcasts one tensor
per broadcast in that order, so consecutive calls receive consecutive broadcasts. Generation is paused
(`in_place`: running requests keep their KV cache and continue afterwards) before the first call and resumed
after the last, and the version is set (`/update_weight_version`) only after the last, so to requests the swap
is atomic. A call that fails ends the update: generation is resumed and the error names the chunk; SGLang's
weights are then partly updated, so the engine must be restarted. Each tensor-parallel worker of SGLang is a
rank of the weight-update group (`rank_offset` + its TP rank); joining checks that they all fit in the world
size. SGLang joins the group with its own timeout (torch's default, 30 minutes), not the request's `timeout_s`.

Where it differs from the contract, because SGLang's endpoints do not allow more:
- The update pauses generation for the whole broadcast, not only for the switch: SGLang receives inside its
  scheduler loop.
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
import logging
import re
import time
import uuid
from collections.abc import Sequence
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
    ParamSpec,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsChecksumResponse,
)
from pipelinerl.contracts.routes import ContractError
from pipelinerl.engines.common import (
    FrontMetrics,
    ModelFacts,
    check_generate,
    check_update,
    completions_via_generate,
    effective_top_k,
    json_body,
    param_nbytes,
    versions_from_spans,
)
from pipelinerl.engines.stops import apply_stop

log = logging.getLogger(__name__)

# The first release whose /pause_generation can keep running requests (`mode: in_place`); see the docstring.
MIN_VERSION = (0, 5, 6)
DEFAULT_UPDATE_CHUNK_BYTES = 1 << 30


@dataclass
class SGLangSettings:
    max_model_len: int
    max_running_seqs: int
    initial_version: int = 0
    # the most bytes of tensors one /update_weights_from_distributed call takes (SGLang holds them all on the GPU
    # at once); config key weight_sync.sglang_update_chunk_mb
    update_chunk_bytes: int = DEFAULT_UPDATE_CHUNK_BYTES


class SGLangBackend:
    """Implements `pipelinerl.contracts.routes.EngineBackend` over SGLang's native HTTP API at `url`."""

    def __init__(self, url: str, model_name: str, facts: ModelFacts, settings: SGLangSettings, tokenizer=None):
        self.url, self.model_name, self.facts, self.settings = url.rstrip("/"), model_name, facts, settings
        self.tokenizer = tokenizer
        self.version = settings.initial_version
        self.metrics = FrontMetrics()
        self._group_name: str | None = None
        self.server_version: str | None = None  # SGLang's, from inspect_server
        self.tp_size = 1  # SGLang's tensor-parallel workers, each a rank of the weight-update group
        self._update_lock = asyncio.Lock()
        self._in_flight: dict[str, list[str]] = {}  # contract request id -> SGLang rids
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            # idle connections dropped well before the server's own keep-alive timeout (uvicorn's, which both
            # servers run on: 5 s): at httpx's default of 5 s too, a connection the server had just closed was
            # reused now and then, and the request failed with "Server disconnected without sending a response"
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=1.0)
            self._http = httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    def inspect_server(self, timeout_s: float = 30.0) -> None:
        """Read SGLang's version and tensor-parallel size from its info route (`/server_info` from 0.5.6,
        `/get_server_info` before and still after); refuse a release older than `MIN_VERSION`. Called once
        SGLang is healthy, before any update."""
        info: dict[str, Any] = {}
        for route in ("/server_info", "/get_server_info"):
            resp = httpx.get(self.url + route, timeout=timeout_s)
            if resp.status_code == 200 and isinstance(body := json_body(resp), dict):
                info = body
                break
        version = str(info.get("version", ""))
        release = _release(version)
        if release is None:
            log.warning("SGLang at %s reports no version I can read (%r); assuming %s or later", self.url, version,
                        ".".join(map(str, MIN_VERSION)))
        elif release < MIN_VERSION:
            raise RuntimeError(f"SGLang {version} is older than {'.'.join(map(str, MIN_VERSION))}: its "
                               "/pause_generation aborts every running request, so every weight update would cut "
                               "all in-flight samples short; install sglang>=0.5.6 (`pip install -e '.[sglang]'`)")
        self.server_version = version or "unknown"
        self.tp_size = int(info.get("tp_size") or 1)

    async def _know_server(self) -> None:
        if self.server_version is None:
            await asyncio.to_thread(self.inspect_server)

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
                       "sampling_params": self._sampling_params(p, max_new, i, self.facts.vocab_size)}
                      for i, r in enumerate(rids)]
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
    def _sampling_params(p: SamplingParams, max_new: int, sample: int, vocab_size: int) -> dict[str, Any]:
        """SGLang's `sampling_params` for sample `sample` of a request (sglang/srt/sampling/sampling_params.py)."""
        top_k = effective_top_k(p.top_k, vocab_size) or -1  # SGLang's "off" is -1
        out: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": top_k,
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
        await self._know_server()
        last = req.rank_offset + self.tp_size - 1
        if last >= req.world_size:
            raise ContractError(400, f"SGLang runs {self.tp_size} tensor-parallel workers, each a rank of the group: "
                                     f"ranks {req.rank_offset}..{last} do not fit in world_size {req.world_size} "
                                     f"(the trainer must count {self.tp_size} ranks for this engine)", "world_size")
        async with self._update_lock:
            previous, self._group_name = self._group_name, None
            # SGLang keeps a group until told to destroy it, and cannot form another under the same name (an
            # engine joins again after a trainer restart). Destroying one it does not have is a harmless failure.
            for name in dict.fromkeys(n for n in (previous, req.group_name) if n):
                await self._control("/destroy_weights_update_group", {"group_name": name}, "leave the group",
                                    required=False)
            await self._control("/init_weights_update_group", {
                "master_address": req.master_address, "master_port": req.master_port,
                "rank_offset": req.rank_offset, "world_size": req.world_size, "group_name": req.group_name,
                "backend": req.backend}, "join the weight-update group", status=504, type="weight_sync_error")
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
            await self._know_server()
            t0 = time.perf_counter()
            await self._control("/pause_generation", {"mode": "in_place"}, "pause generation")
            try:
                await self._receive_in_chunks(req)
                receive_s = time.perf_counter() - t0
                await self._control("/update_weight_version", {"new_version": str(req.version),
                                                               "abort_all_requests": False},
                                    f"switch to version {req.version}")
            except BaseException:
                await self._continue(failed=True)
                raise
            await self._continue(failed=False)
            switch_s = time.perf_counter() - t0
            self.version = req.version
            nbytes = sum(param_nbytes(p.dtype, p.shape) for p in req.params)
            self.metrics.update_done(nbytes, receive_s, switch_s)
            return UpdateWeightsResponse(version=req.version, received_bytes=nbytes, receive_s=receive_s,
                                         switch_s=switch_s)

    async def _receive_in_chunks(self, req: UpdateWeightsRequest) -> None:
        """One `/update_weights_from_distributed` call per chunk of the update, in order (while paused)."""
        chunks = update_chunks(req.params, self.settings.update_chunk_bytes)
        for k, (start, stop) in enumerate(chunks):
            params = req.params[start:stop]
            nbytes = sum(param_nbytes(p.dtype, p.shape) for p in params)
            what = (f"receive chunk {k + 1} of {len(chunks)} of version {req.version} (params[{start}:{stop}], "
                    f"{nbytes / 2**20:.1f} MiB)")
            # flush_cache off: with the scheduler paused in place it fails while requests are running, and the
            # radix cache it would flush is off (see sglang_command). No weight_version: set after the last chunk.
            await self._control("/update_weights_from_distributed", {
                "names": [p.name for p in params], "dtypes": [p.dtype for p in params],
                "shapes": [p.shape for p in params], "group_name": req.group_name, "flush_cache": False},
                what, status=500, type="engine_error",
                after="SGLang's weights are now partly updated: restart the engine")

    async def _continue(self, failed: bool) -> None:
        """Resume generation after an update; after a failed one, a failure to resume is logged, not raised
        (the update's own error is the one to report)."""
        try:
            await self._control("/continue_generation", {}, "resume generation")
        except Exception as e:
            if not failed:
                raise
            log.error("after a failed update, %s", e)

    async def _control(self, path: str, body: dict[str, Any], what: str, status: int = 500,
                       type: str = "engine_error", after: str = "", required: bool = True) -> Any:
        """Post to one of SGLang's control routes, which answer `{"success": false, "message": ...}` (400) when
        they fail; raise a ContractError saying what could not be done (unless not `required`)."""
        resp = await self.http.post(path, json=body)
        data = json_body(resp)
        failed = resp.status_code >= 400 or (isinstance(data, dict) and data.get("success") is False)
        if failed and required:
            message = data.get("message") or data.get("detail") or data if isinstance(data, dict) else data
            after = f"; {after}" if after else ""
            raise ContractError(status, f"SGLang could not {what} ({path} answered {resp.status_code}: "
                                        f"{message}){after}", type=type)
        return data

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


def update_chunks(params: Sequence[ParamSpec], max_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) index ranges splitting `params`, in order, into the fewest consecutive chunks of at most
    `max_bytes` each; a parameter larger than that is a chunk of its own."""
    chunks: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, p in enumerate(params):
        n = param_nbytes(p.dtype, p.shape)
        if i > start and size + n > max_bytes:
            chunks.append((start, i))
            start, size = i, 0
        size += n
    if params:
        chunks.append((start, len(params)))
    return chunks


def _release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as 0.5.6, 0.5.6.post1 or 0.5.10rc0."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


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

