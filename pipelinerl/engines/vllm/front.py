"""The contract served over a running vLLM OpenAI server: an `EngineBackend` that drives vLLM's own HTTP API.

- Generation: `POST /inference/v1/generate` (vLLM's tokens-in/tokens-out route, `--enable-scale-out`) with the
  prompt's token ids; vLLM is started with `--logprobs-mode processed_logprobs`, so the log-prob it reports for
  a sampled token is log softmax(logits / temperature) (temperature 1 for greedy rows), as the contract says.
  Per-token versions come from the `weight_versions` spans vLLM attaches to every finished choice.
- Weight updates: the worker extension (`worker_extension.py`) through `POST /collective_rpc`
  (`VLLM_SERVER_DEV_MODE=1`), which calls every worker (one per tensor-parallel rank) and answers with a list
  of their results: a step succeeds only if every worker's does, and an update is received only when every
  worker has it. Receiving runs on a thread in each worker while vLLM keeps decoding, and each worker's thread
  reports the end of its receive on a loopback socket of the front (`ReceiveNotices`); the switch runs with the
  scheduler paused in `keep` mode and `clear_cache=false` (running requests keep their KV cache and
  continue), and relabels vLLM's weight version in the same pause, so the version vLLM stamps on each engine
  step is exactly the weights that step ran with.
- Abort: `POST /abort_requests` with vLLM's external request ids; vLLM answers the aborted requests with
  what they generated and finish reason `abort`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
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

# vLLM prefixes the request id of /inference/v1/generate with this to make its external id.
_EXTERNAL_PREFIX = "generate-tokens-"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# Without every worker's notice for this long, the receive status is asked through the engine loop instead (a
# worker that could not reach the front's socket). Longer than the 1 s vLLM's workers busy-wait after each
# call (`SpinCondition` in vllm/distributed/device_communicators/shm_broadcast.py, 0.32): a poll each second
# kept both cores of a 2-core machine busy for as long as an update was awaited.
_FALLBACK_POLL_S = 5.0


@dataclass
class FrontSettings:
    max_model_len: int
    max_running_seqs: int
    initial_version: int = 0
    update_timeout_s: float = 600.0
    tensor_parallel_size: int = 1  # vLLM's workers: each one is a rank of the weight-update group


def merge_receive_status(statuses: list[Any], workers: int) -> dict:
    """One status for the update from every worker's `pipelinerl_receive_status`: done when all are done, the
    first error (naming its worker) when any failed. A missing answer is an error, not a worker that is done."""
    if len(statuses) != workers or not all(isinstance(x, dict) for x in statuses):
        return {"done": True, "error": f"expected a receive status from each of {workers} vLLM workers, got "
                                       f"{statuses!r}", "seconds": 0.0}
    errors = [f"worker {i}: {x['error']}" for i, x in enumerate(statuses) if x.get("error")]
    return {"done": all(x.get("done") for x in statuses) or bool(errors), "error": errors[0] if errors else None,
            "seconds": max(float(x.get("seconds") or 0.0) for x in statuses)}


class ReceiveNotices:
    """A loopback socket on which each vLLM worker's receiving thread says that its receive ended, with its
    status (`pipelinerl_receive_status`'s dict), as one JSON line {"token", "worker", "status"}.

    Why not poll the status: each poll is a `collective_rpc`, which crosses vLLM's API server, its engine loop
    and every worker. Polled every 2 ms, an engine waiting for a broadcast kept both cores of a 2-core machine
    busy, starving the trainer's broadcast and the receiving threads it
    waited for. A notice costs one connection per worker per update. Each update has a random token, so
    another local process cannot end an update's wait."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self._pending: dict[str, tuple[dict[int, dict], asyncio.Event, int]] = {}

    async def start(self) -> int:
        """Listen on 127.0.0.1 (once); returns the port."""
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def expect(self, workers: int) -> str:
        """A token for one update whose receive ends with a notice from each of `workers` workers."""
        token = uuid.uuid4().hex
        self._pending[token] = ({}, asyncio.Event(), workers)
        return token

    async def wait(self, token: str, timeout_s: float) -> list[dict] | None:
        """Every worker's status, in worker order, once all have reported or one reported an error (the others
        then count as done); None if neither happened in `timeout_s`."""
        statuses, event, workers = self._pending[token]
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return [statuses.get(w, {"done": True}) for w in range(workers)]

    def forget(self, token: str) -> None:
        self._pending.pop(token, None)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            msg = json.loads(await asyncio.wait_for(reader.readline(), 10.0))
            statuses, event, workers = self._pending.get(msg["token"], ({}, None, 0))
            worker = int(msg["worker"])
            if event is not None and 0 <= worker < workers:
                statuses[worker] = dict(msg["status"])
                if len(statuses) >= workers or statuses[worker].get("error"):
                    event.set()  # all done, or one failed (the others may wait in the broadcast for good)
        except (asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignored a malformed receive notice: %s: %s", type(e).__name__, e)
        finally:
            writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


def check_group_ranks(req: InitWeightUpdateGroupRequest, workers: int) -> None:
    """Every worker of this engine needs a rank of the group: ranks rank_offset .. rank_offset + workers - 1."""
    last = req.rank_offset + workers - 1
    if last >= req.world_size:
        raise ContractError(400, f"this vLLM engine has {workers} workers (tensor parallel), each a rank of the "
                                 f"group: ranks {req.rank_offset}..{last} do not fit in world_size "
                                 f"{req.world_size}; the trainer must count {workers} ranks per engine "
                                 f"(ranks_per_engine={workers})", "world_size")


class VLLMBackend:
    """Implements `pipelinerl.contracts.routes.EngineBackend` over vLLM's HTTP API at `url`."""

    def __init__(self, url: str, model_name: str, facts: ModelFacts, settings: FrontSettings, tokenizer=None,
                 uds: str | None = None):
        self.url, self.model_name, self.facts, self.settings = url.rstrip("/"), model_name, facts, settings
        self.uds = uds  # vLLM's unix socket, when it listens on one (`url` is then only the requests' base)
        self.tokenizer = tokenizer
        self.version = settings.initial_version
        self.metrics = FrontMetrics()
        self._group_name: str | None = None
        self._group_backend = "gloo"
        self._mixed_weights = False  # a streamed update failed midway (see _streamed_update)
        # set except while a streamed update runs: a generation that arrives then waits for it to end, and then
        # either runs on the new weights or is refused (409) if the update failed, never on half of each
        self._not_streaming = asyncio.Event()
        self._not_streaming.set()
        self._update_lock = asyncio.Lock()
        self._in_flight: set[str] = set()
        self._http: httpx.AsyncClient | None = None
        self._notices = ReceiveNotices()

    @property
    def http(self) -> httpx.AsyncClient:
        """Created on first use, inside the server's event loop."""
        if self._http is None:
            # idle connections dropped well before the server's own keep-alive timeout (uvicorn's, which both
            # servers run on: 5 s): at httpx's default of 5 s too, a connection the server had just closed was
            # reused now and then, and the request failed with "Server disconnected without sending a response"
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=1.0)
            transport = httpx.AsyncHTTPTransport(uds=self.uds, limits=limits) if self.uds else None
            self._http = httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits, transport=transport)
        return self._http

    async def start(self) -> None:
        """Label vLLM's weights with the initial version (vLLM starts at "default")."""
        await self._post("/update_weight_version", {"new_version": str(self.version)})

    async def aclose(self) -> None:
        await self._notices.aclose()
        if self._http is not None:
            await self._http.aclose()

    # --- generation ----------------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        await self._not_streaming.wait()
        if self._mixed_weights:
            raise ContractError(409, "this engine's weights are partly of two versions (an update failed midway); "
                                     "it generates again after the next complete update", type="conflict")
        s = self.settings
        max_new = check_generate(req, self.facts.vocab_size, s.max_model_len, s.max_running_seqs, self.tokenizer)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._in_flight:
            raise ContractError(409, f"request_id {rid!r} is already running", "request_id")
        p = req.sampling
        top_k = effective_top_k(p.top_k, self.facts.vocab_size)
        body = {"request_id": rid, "token_ids": req.prompt_token_ids, "output_mode": "tokens",
                "sampling_params": {"n": p.n, "temperature": p.temperature, "top_p": p.top_p, "top_k": top_k,
                                    "seed": p.seed, "max_tokens": max_new, "stop_token_ids": p.stop_token_ids,
                                    "ignore_eos": p.ignore_eos, "logprobs": 0, "detokenize": False}}
        if p.stop:
            # vLLM matches stop strings in the text it detokenizes (skipping special tokens) and keeps the token
            # that completed one, dropping any generated after it in the same step (vllm/v1/engine/detokenizer.py)
            body["sampling_params"].update(stop=p.stop, include_stop_str_in_output=True, detokenize=True,
                                           skip_special_tokens=True)
        start_version = self.version
        self._in_flight.add(rid)
        self.metrics.request_started()
        tokens = 0
        try:
            resp = await self._post_unsent_once("/inference/v1/generate", body)
            out = self._parse_generate(rid, len(req.prompt_token_ids), p.n, resp, start_version)
            if p.stop:
                out.completions = [self._enforce_stop(c, p.stop) for c in out.completions]
            tokens = sum(len(c.token_ids) for c in out.completions)
            return out
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            await asyncio.shield(self._abort_ids([rid]))
            raise
        finally:
            self._in_flight.discard(rid)
            self.metrics.request_ended(tokens)

    def _parse_generate(self, rid: str, prompt_len: int, n: int, resp: httpx.Response,
                        start_version: int) -> GenerateResponse:
        body = json_body(resp)
        if resp.status_code >= 400:
            raise _engine_error(resp.status_code, body)
        choices = sorted(body.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != n:
            raise ContractError(500, f"vLLM returned {len(choices)} choices for n={n}", type="engine_error")
        completions = []
        for c in choices:
            token_ids = list(c.get("token_ids") or [])
            content = (c.get("logprobs") or {}).get("content") or []
            logprobs = [float(x["logprob"]) for x in content]
            if len(logprobs) != len(token_ids):
                raise ContractError(500, f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens",
                                    type="engine_error")
            spans = [(int(v["version"]), int(v["start"]), int(v["end"])) for v in c.get("weight_versions") or []
                     if str(v["version"]).lstrip("-").isdigit()]
            reason = _FINISH.get(c.get("finish_reason") or "", None)
            if reason is None:
                raise ContractError(500, f"vLLM finished with {c.get('finish_reason')!r}", type="engine_error")
            completions.append(Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                                          versions=versions_from_spans(spans, len(token_ids), start_version)))
        return GenerateResponse(request_id=rid, prompt_len=prompt_len, completions=completions)

    def _enforce_stop(self, c: Completion, stops: list[str]) -> Completion:
        """The contract's stop-string definition on vLLM's completion. vLLM does the same itself, but decodes the
        output in the prompt's context (its DecodeStream is primed with the prompt) where the contract decodes the
        output alone: where the two differ (a leading space, a character split across the prompt's end), the
        contract decides, and the log says so."""
        fixed = apply_stop(c, self.tokenizer, stops)
        if fixed is not c:
            log.warning("stop strings %r: vLLM returned %d tokens (%s), the contract's definition %d (stop)", stops,
                        len(c.token_ids), c.finish_reason, len(fixed.token_ids))
        return fixed

    async def completions(self, req: CompletionsRequest) -> CompletionsResponse:
        return await completions_via_generate(req, self.tokenizer, self.model_name, self.generate)

    async def abort(self, request_id: str | None) -> list[str]:
        targets = sorted(self._in_flight) if request_id is None else (
            [request_id] if request_id in self._in_flight else [])
        if targets:
            await self._abort_ids(targets)
        return targets

    async def _abort_ids(self, rids: list[str]) -> None:
        await self._post("/abort_requests", {"request_ids": [_EXTERNAL_PREFIX + r for r in rids]})

    # --- weights -------------------------------------------------------------------------------------------

    async def init_weight_update_group(self, req: InitWeightUpdateGroupRequest) -> None:
        import torch

        if req.backend == "nccl" and not torch.cuda.is_available():
            raise ContractError(400, "backend 'nccl' needs a GPU; use 'gloo' on CPU", "backend")
        workers = self.settings.tensor_parallel_size
        check_group_ranks(req, workers)
        async with self._update_lock:
            self._group_name = None
            try:
                ranks = await self._join(req)
            except ContractError as e:
                raise ContractError(504, e.message, type="weight_sync_error") from None
            if len(ranks) != workers:
                raise ContractError(500, f"{len(ranks)} vLLM workers joined the group, expected {workers} "
                                         "(--tensor-parallel-size)", type="weight_sync_error")
            self._group_name = req.group_name
            self._group_backend = req.backend

    async def _join(self, req: InitWeightUpdateGroupRequest) -> list[dict]:
        """Every worker's join, started on its own thread and polled (generation goes on meanwhile): their
        `{"rank"}` once all joined, the contract's 504 within `timeout_s` (and a few seconds) when any fails or
        does not finish, the workers then left in no group."""
        from pipelinerl.weight_sync import JOIN_GRACE_S

        ranks = await self._rpc("pipelinerl_init_group", req.model_dump(), timeout_s=60.0)
        deadline = time.monotonic() + req.timeout_s + JOIN_GRACE_S + 1.0
        while True:
            statuses = await self._rpc("pipelinerl_join_status", timeout_s=60.0)
            errors = [f"worker {i}: {st['error']}" for i, st in enumerate(statuses) if st.get("error")]
            if errors or time.monotonic() > deadline:
                await self._rpc("pipelinerl_abandon_join", timeout_s=60.0)
                reason = "; ".join(errors) or (f"the join did not finish within timeout_s={req.timeout_s:g} at "
                                               f"{req.master_address}:{req.master_port}")
                raise ContractError(504, f"joining weight-update group {req.group_name!r} failed: {reason}",
                                    type="weight_sync_error")
            if all(st.get("done") for st in statuses):
                return ranks
            await asyncio.sleep(0.1)

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        async with self._update_lock:
            if self._group_name is None or self._group_name != req.group_name:
                raise ContractError(409, f"not in weight-update group {req.group_name!r}; call "
                                         "/v1/weights/init_group first", "group_name", "conflict")
            t0 = time.perf_counter()
            problem = check_update(req.params, self.facts.params)
            specs = [[p.name, p.dtype, p.shape] for p in req.params]
            if await self._update_mode(specs) == "stream":
                return await self._streamed_update(req, specs, problem, t0)
            port = await self._notices.start()
            token = self._notices.expect(self.settings.tensor_parallel_size)
            try:
                # A refused update is still drained (into scratch memory), so the trainer is not left hanging.
                await self._rpc("pipelinerl_start_receive",
                                {"specs": specs, "bucket_bytes": req.bucket_bytes, "apply": problem is None,
                                 "notify": {"port": port, "token": token}})
                status = await self._wait_received(token)
            finally:
                self._notices.forget(token)
            if problem is not None:
                self.metrics.refused_updates += 1
                raise ContractError(400, problem[1], problem[0], "mismatched_update")
            if status.get("error"):
                raise ContractError(504, f"receiving the update failed: {status['error']}", type="weight_sync_error")
            receive_s = time.perf_counter() - t0
            switch_s = await self._switch(req.version)
            nbytes = sum(param_nbytes(p.dtype, p.shape) for p in req.params)
            self.metrics.update_done(nbytes, receive_s, switch_s)
            return UpdateWeightsResponse(version=req.version, received_bytes=nbytes, receive_s=receive_s,
                                         switch_s=switch_s)

    async def _update_mode(self, specs: list) -> str:
        """"stream" when any worker would stream this update (every worker must take it the same way), else
        "stage" (worker_extension.update_mode). Over gloo updates are staged unless PIPELINERL_VLLM_STAGING says
        stream: no question to the workers then."""
        from pipelinerl.engines.vllm.worker_extension import STAGING_ENV

        if self._group_backend != "nccl" and os.environ.get(STAGING_ENV, "auto") != "stream":
            return "stage"
        modes = [r.get("mode") for r in await self._rpc("pipelinerl_update_mode", {"specs": specs})]
        return "stream" if "stream" in modes else "stage"

    async def _streamed_update(self, req: UpdateWeightsRequest, specs: list, problem: tuple[str, str] | None,
                               t0: float) -> UpdateWeightsResponse:
        """Generation paused, the update received straight into the weights (worker_extension's "stream"), the
        version relabelled, generation resumed. A refused update is drained first (two buckets of memory)."""
        missing = [name for name in self.facts.params if name not in {p.name for p in req.params}
                   and not (name == "lm_head.weight" and self.facts.tied_embeddings)]
        if problem is None and missing:
            problem = ("params", f"the update leaves out {len(missing)} of the model's parameters (first: "
                                 f"{missing[0]!r}), and this engine streams updates into its weights (an update too "
                                 "large to stage on the GPU beside vLLM, or PIPELINERL_VLLM_STAGING=stream), which "
                                 "takes every parameter; send all of them, or stage updates in host memory with "
                                 "PIPELINERL_VLLM_STAGING=cpu")
        if problem is not None:
            port = await self._notices.start()
            token = self._notices.expect(self.settings.tensor_parallel_size)
            try:
                await self._rpc("pipelinerl_start_receive", {"specs": specs, "bucket_bytes": req.bucket_bytes,
                                                             "apply": False, "notify": {"port": port, "token": token}})
                await self._wait_received(token)
            finally:
                self._notices.forget(token)
            self.metrics.refused_updates += 1
            raise ContractError(400, problem[1], problem[0], "mismatched_update")
        self._not_streaming.clear()
        await self._post("/pause", None, params={"mode": "keep", "clear_cache": "false"})
        try:
            try:
                results = await self._rpc("pipelinerl_receive_and_load",
                                          {"specs": specs, "bucket_bytes": req.bucket_bytes},
                                          timeout_s=self.settings.update_timeout_s)
            except ContractError as e:
                self._mixed_weights = True
                raise ContractError(504, f"receiving the update failed: {e.message}; the engine's weights are now "
                                         "partly new and partly old, so it refuses to generate until the next "
                                         "complete update", type="weight_sync_error") from None
            await self._post("/update_weight_version", {"new_version": str(req.version)})
            self.version = req.version
            self._mixed_weights = False
        finally:
            try:
                await self._post("/resume", None)
            finally:
                self._not_streaming.set()
        nbytes = sum(param_nbytes(p.dtype, p.shape) for p in req.params)
        switch_s = max(float(r.get("switch_s", 0.0)) for r in results)
        self.metrics.update_done(nbytes, time.perf_counter() - t0, switch_s)
        return UpdateWeightsResponse(version=req.version, received_bytes=nbytes, receive_s=time.perf_counter() - t0,
                                     switch_s=switch_s)

    async def _wait_received(self, token: str) -> dict:
        """Every worker's receive status once all are done (or one failed): from their notices, or, where a
        notice is late, from a status poll through the engine loop."""
        workers = self.settings.tensor_parallel_size
        deadline = time.monotonic() + self.settings.update_timeout_s
        while True:
            statuses = await self._notices.wait(token, min(_FALLBACK_POLL_S, max(0.0, deadline - time.monotonic())))
            if statuses is None:
                log.info("no receive notice from every vLLM worker in %.0f s (a long receive, or a worker that "
                         "cannot reach this front's loopback socket): asking them for the update's status",
                         _FALLBACK_POLL_S)
                statuses = await self._rpc("pipelinerl_receive_status")
            status = merge_receive_status(statuses, workers)
            if status.get("done"):
                return status
            if time.monotonic() > deadline:
                raise ContractError(504, "the update's broadcast did not finish in time", type="weight_sync_error")

    async def _switch(self, version: int) -> float:
        """Pause vLLM's scheduler between two steps (keeping running requests and their KV cache), load the
        received weights, relabel the version, resume: every step after the pause runs the new weights and
        is stamped with the new version."""
        t0 = time.perf_counter()
        await self._post("/pause", None, params={"mode": "keep", "clear_cache": "false"})
        try:
            await self._rpc("pipelinerl_switch")
            await self._post("/update_weight_version", {"new_version": str(version)})
            self.version = version
        finally:
            await self._post("/resume", None)
        return time.perf_counter() - t0

    async def weights_checksum(self) -> WeightsChecksumResponse:
        raise ContractError(501, "vLLM keeps CPU linear weights only in packed kernel form (and fuses q/k/v and "
                                 "gate/up): there are no per-parameter bytes to hash", type="not_implemented")

    def info(self) -> InfoResponse:
        s = self.settings
        return InfoResponse(engine="vllm", model=self.model_name, weight_version=self.version,
                            max_model_len=s.max_model_len, vocab_size=self.facts.vocab_size,
                            max_running_seqs=s.max_running_seqs, eos_token_ids=self.facts.eos_token_ids,
                            weight_group=self._group_name)

    def metrics_text(self) -> str:
        return self.metrics.text(self.version)

    # --- vLLM calls ----------------------------------------------------------------------------------------

    async def _rpc(self, method: str, payload: Any = None, timeout_s: float | None = None) -> list[Any]:
        """Call a worker-extension method on every worker; its results, one per worker."""
        body: dict[str, Any] = {"method": method, "args": [] if payload is None else [json.dumps(payload)]}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        resp = await self.http.post("/collective_rpc", json=body)
        data = json_body(resp)
        if resp.status_code >= 400:
            raise _engine_error(resp.status_code, data, f"collective_rpc {method}")
        return data.get("results", []) if isinstance(data, dict) else []

    async def _post_unsent_once(self, path: str, body: Any) -> httpx.Response:
        """POST, sent again once if the connection closed before vLLM answered anything (a keep-alive connection
        the server closed as it was reused: the request never reached vLLM, so nothing runs twice)."""
        try:
            return await self.http.post(path, json=body)
        except httpx.RemoteProtocolError as e:
            if "without sending a response" not in str(e):
                raise
            log.info("vLLM closed a connection before answering (%s); sending the request again", e)
            return await self.http.post(path, json=body)

    async def _post(self, path: str, body: Any, params: dict | None = None) -> Any:
        resp = await self.http.post(path, json=body, params=params)
        data = json_body(resp)
        if resp.status_code >= 400:
            raise _engine_error(resp.status_code, data, f"vLLM {path}")
        return data



def _engine_error(status: int, body: Any, what: str = "vLLM") -> ContractError:
    """vLLM's error as the contract's: its 4xx stay 4xx (input the front did not catch), the rest are 5xx."""
    err = body.get("error") if isinstance(body, dict) else None
    message = (err.get("message") if isinstance(err, dict) else err) or (
        body.get("detail") if isinstance(body, dict) else None) or str(body)
    if 400 <= status < 500:
        return ContractError(400, f"{what}: {message}")
    return ContractError(500, f"{what} answered {status}: {message}", type="engine_error")

