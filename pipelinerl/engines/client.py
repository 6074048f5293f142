"""A client of the inference contract, used by the actor, the trainer, the eval harness and the tests."""

from __future__ import annotations

import functools
import http.client
import json
import select
import socket
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
from pydantic import TypeAdapter

from pipelinerl.auth import api_key_from_env, auth_headers
from pipelinerl.contracts.inference import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    InitWeightUpdateGroupRequest,
    ParamSpec,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)

if TYPE_CHECKING:  # torch is imported where tensors are: a process that only generates (the actor) never loads it
    from pipelinerl.weight_sync import TensorSpec, WeightUpdateGroup


class EngineError(RuntimeError):
    """The engine answered with an error; `status` and `field` come from its JSON body."""

    def __init__(self, url: str, status: int, body: Any):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status, self.field = status, err.get("field")
        self.message = err.get("message") or str(body)
        super().__init__(f"{url} answered {status}: {self.message}")


def _check(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    if resp.status_code >= 400:
        raise EngineError(str(resp.url), resp.status_code, body)
    return body


class EngineClient:
    """Blocking calls to one engine. Thread-safe (httpx.Client is), except that one weight update at a time
    goes through `send_update` / `finish_update`."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None):
        """`api_key`: sent on every request; default `PIPELINERL_API_KEY` from the environment (pipelinerl.auth)."""
        self.url = url.rstrip("/")
        self._headers = auth_headers(api_key or api_key_from_env())
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=self._headers)
        self._timeout_s = timeout_s
        self._update_conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        self._http.close()
        self.abandon_update()

    def health(self) -> bool:
        try:
            return self._http.get("/v1/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 120.0, process: Any = None, check: Callable[[], None] | None = None
                     ) -> None:
        """Poll /v1/health; fail early if `process` (a Popen) exits, or with what `check` raises (called each poll)."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if check is not None:
                check()
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"engine at {self.url} exited with code {process.returncode} before healthy")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {self.url} not healthy after {timeout_s:g}s")
            time.sleep(0.1)

    def info(self) -> InfoResponse:
        return InfoResponse.model_validate(_check(self._http.get("/v1/info")))

    def metrics(self) -> dict[str, float]:
        """Prometheus text parsed into {name: value} (labels dropped)."""
        out: dict[str, float] = {}
        for line in _check_text(self._http.get("/metrics")).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name.split("{")[0]] = float(value)
        return out

    def generate(self, prompt_token_ids: Sequence[int], request_id: str | None = None,
                 **sampling: Any) -> GenerateResponse:
        req = GenerateRequest(prompt_token_ids=list(prompt_token_ids), request_id=request_id,
                              sampling=SamplingParams(**sampling))
        return GenerateResponse.model_validate(_check(self._http.post("/v1/generate", json=req.model_dump())))

    def post(self, path: str, body: Any) -> Any:
        return _check(self._http.post(path, json=body))

    def abort(self, request_id: str | None = None) -> list[str]:
        return self.post("/v1/abort", {"request_id": request_id})["aborted"]

    def init_weight_update_group(self, req: InitWeightUpdateGroupRequest) -> None:
        self.post("/v1/weights/init_group", req.model_dump())

    def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        return UpdateWeightsResponse.model_validate(self.post("/v1/weights/update", req.model_dump()))

    # `update_weights` in two halves, so that the trainer's own thread can post an update to every engine, then
    # broadcast, then read the answers: no hand-off to another thread on the update's critical path (each one
    # is latency, the more so on a loaded machine). Over a plain keep-alive HTTP/1.1 connection of its own,
    # since httpx cannot send a request without waiting for its answer.

    def send_update(self, body: bytes) -> None:
        """Post an update request (`update_request_body`) without waiting for the answer."""
        conn = self._update_connection()
        try:
            conn.request("POST", f"{self._path_prefix}/v1/weights/update", body=body,
                         headers={"content-type": "application/json", **self._headers})
        except Exception:
            self.abandon_update()
            raise

    def finish_update(self) -> UpdateWeightsResponse:
        """Wait for the answer to `send_update` (the engine answers once it received and switched)."""
        conn = self._update_conn
        if conn is None:
            raise RuntimeError("finish_update without send_update")
        try:
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except Exception:
            self.abandon_update()
            raise
        return UpdateWeightsResponse.model_validate(_check_body(self.url, status, raw))

    def abandon_update(self) -> None:
        """Drop the update connection (an answer that will not be read must not be read by the next one)."""
        if self._update_conn is not None:
            self._update_conn.close()
            self._update_conn = None

    @property
    def _path_prefix(self) -> str:
        return urllib.parse.urlsplit(self.url).path

    def _update_connection(self) -> http.client.HTTPConnection:
        conn = self._update_conn
        if conn is not None and conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
            # Readable while idle: the server closed the keep-alive connection (its idle timeout is shorter
            # than the time between two updates). A request written into it would be lost; open a new one.
            self.abandon_update()
            conn = None
        if conn is None:
            parts = urllib.parse.urlsplit(self.url)
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = self._update_conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=self._timeout_s)
            # http.client writes a request's headers and its body apart; with Nagle's algorithm on, the body
            # would wait for the engine to acknowledge the headers (up to its delayed-ACK time, 40 ms on Linux)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


class AsyncEngineClient:
    """Non-blocking calls to one engine, for the asyncio actor; `in_flight` counts its open requests so
    callers can spread load across engines.

    On aiohttp: for a batch of concurrent generate calls to one engine it takes a small fraction of the client
    CPU that httpx's AsyncClient takes, and the batch comes back sooner (on a machine of few cores the client's
    CPU time is time the engines and the trainer do not get). The session is made on first use,
    inside the running event loop, as aiohttp requires."""

    def __init__(self, url: str, timeout_s: float = 3600.0, max_connections: int = 256, api_key: str | None = None):
        self.url = url.rstrip("/")
        self._timeout_s, self._max_connections = timeout_s, max_connections
        self._headers = auth_headers(api_key or api_key_from_env())
        self._session = None
        self.in_flight = 0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        url = f"{self.url}/v1/generate"
        self.in_flight += 1
        try:
            async with self._http().post(url, data=req.model_dump_json(), headers=_JSON) as resp:
                status, raw = resp.status, await resp.read()
        except aiohttp.ClientError as e:
            raise ConnectionError(f"engine at {self.url} unreachable: {type(e).__name__}: {e}; is it running?") from e
        finally:
            self.in_flight -= 1
        if status >= 400:
            _check_body(url, status, raw)
        return GenerateResponse.model_validate_json(raw)


_JSON = {"content-type": "application/json"}


def _check_body(url: str, status: int, raw: bytes) -> Any:
    """`_check` for an answer read with http.client."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    if status >= 400:
        raise EngineError(url, status, body)
    return body


def _check_text(resp: httpx.Response) -> str:
    if resp.status_code >= 400:
        _check(resp)
    return resp.text


def param_specs(named: Sequence[tuple[str, Any]]) -> list[ParamSpec]:
    from pipelinerl.weight_sync import DTYPE_NAMES

    return [ParamSpec(name=n, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape)) for n, t in named]


_PARAM_LIST = TypeAdapter(list[ParamSpec])


@functools.lru_cache(maxsize=8)
def _params_json(params: tuple[tuple[str, str, tuple[int, ...]], ...]) -> str:
    return _PARAM_LIST.dump_json([ParamSpec(name=n, dtype=d, shape=list(s)) for n, d, s in params]).decode()


def _as_spec(p: TensorSpec | tuple[str, Any]) -> tuple[str, str, tuple[int, ...]]:
    from pipelinerl.weight_sync import DTYPE_NAMES, TensorSpec

    if isinstance(p, TensorSpec):
        return p.name, DTYPE_NAMES[p.dtype], p.shape
    name, t = p
    return name, DTYPE_NAMES[t.dtype], tuple(t.shape)


def update_request_body(params: Sequence[TensorSpec | tuple[str, Any]], version: int, group_name: str,
                        bucket_bytes: int) -> bytes:
    """The JSON of an `UpdateWeightsRequest` for `params` (specs, or (name, tensor) pairs). Every update of a
    run lists the same parameters, so their part is serialised once and reused: building it per update is
    latency on the trainer's critical path (the engines cannot start receiving before the request arrives)."""
    params_json = _params_json(tuple(_as_spec(p) for p in params))
    head = json.dumps({"version": version, "group_name": group_name, "bucket_bytes": bucket_bytes})
    return f'{head[:-1]}, "params": {params_json}}}'.encode()


def send_update_and_broadcast(group: WeightUpdateGroup | None, engines: Sequence[EngineClient],
                              params: Sequence[TensorSpec | tuple[str, Any]], version: int, bucket_bytes: int,
                              broadcast: Callable[[Callable[[], None]], int]
                              ) -> tuple[int, list[UpdateWeightsResponse]]:
    """Rank 0: post the update of `params` to every engine and run `broadcast(ready)`, which sends the tensors
    and calls `ready()` just before its first broadcast. Returns what `broadcast` returns (the bytes sent) and
    every engine's answer.

    The engines answer only after they received the broadcast and switched, so the requests are sent first
    (once the broadcast is ready to go: the engines handle them while this process waits, not competing for
    the same cores), then the tensors broadcast, then the answers read. Raises the first engine error after
    the broadcast has finished."""
    body = update_request_body(params, version, group.group_name if group else "", bucket_bytes)
    sent: list[EngineClient] = []

    def post_requests() -> None:  # once the broadcast is set to go: this process then waits, not computes
        for e in engines:
            e.send_update(body)
            sent.append(e)

    try:
        nbytes = broadcast(post_requests)
    except BaseException:
        for e in sent:
            e.abandon_update()
        raise
    answers, error = [], None
    for e in engines:  # read every answer, even after an error, so that no connection is left mid-answer
        try:
            answers.append(e.finish_update())
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    return nbytes, answers


def push_weights(group: WeightUpdateGroup, engines: Sequence[EngineClient], named: Sequence[tuple[str, Any]],
                 version: int, bucket_bytes: int = 0) -> list[UpdateWeightsResponse]:
    """Rank 0: post the update to every engine and broadcast the tensors `named` at the same time
    (`send_update_and_broadcast`); returns every engine's answer."""
    from pipelinerl.weight_sync import broadcast_tensors

    return send_update_and_broadcast(
        group, engines, named, version, bucket_bytes,
        lambda ready: broadcast_tensors(group, [t for _, t in named], bucket_bytes, ready))[1]


def init_group_on_engines(engines: Sequence[EngineClient], master_address: str, master_port: int,
                          backend: str, group_name: str, timeout_s: float,
                          ranks_per_engine: int = 1) -> tuple[int, list[Any]]:
    """Start every engine joining the group (on threads); returns (world_size, futures) so the caller can
    join as rank 0 and then wait on the futures."""
    world_size = 1 + ranks_per_engine * len(engines)
    pool = ThreadPoolExecutor(max_workers=max(1, len(engines)))
    futures = []
    for i, e in enumerate(engines):
        req = InitWeightUpdateGroupRequest(master_address=master_address, master_port=master_port,
                                           rank_offset=1 + i * ranks_per_engine, world_size=world_size,
                                           backend=backend, group_name=group_name, timeout_s=timeout_s)
        futures.append(pool.submit(e.init_weight_update_group, req))
    pool.shutdown(wait=False)
    return world_size, futures
