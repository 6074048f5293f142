"""The HTTP front of every engine: routes of the inference contract wired to an `EngineBackend`.

An engine (the embedded one, the vLLM adapter, ...) implements `EngineBackend`; `create_app` turns it into a
FastAPI app with the contract's routes, error format and status codes. The OpenAPI document of the contract is
generated from `create_app(None)`, so routes and models cannot drift apart.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from pipelinerl.contracts.inference import (
    CONTRACT_VERSION,
    AbortRequest,
    AbortResponse,
    CompletionsRequest,
    CompletionsResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    InfoResponse,
    InitWeightUpdateGroupRequest,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsChecksumResponse,
)


class ContractError(Exception):
    """An error to return to the client: `status` 4xx for bad input, 5xx for engine faults."""

    def __init__(self, status: int, message: str, field: str | None = None, type: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.field, self.type = status, message, field, type


class EngineBackend(Protocol):
    """What an engine implements to be served through the contract."""

    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    async def completions(self, req: CompletionsRequest) -> CompletionsResponse: ...

    async def init_weight_update_group(self, req: InitWeightUpdateGroupRequest) -> None: ...

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse: ...

    async def abort(self, request_id: str | None) -> list[str]: ...

    def info(self) -> InfoResponse: ...

    async def weights_checksum(self) -> WeightsChecksumResponse: ...

    def metrics_text(self) -> str: ...


def render_metrics(rows: list[tuple[str, str, float, str]]) -> str:
    """Prometheus text format for (name, kind, value, help) rows; every engine exports the same names."""
    out = []
    for name, kind, value, help_text in rows:
        out += [f"# HELP pipelinerl_{name} {help_text}", f"# TYPE pipelinerl_{name} {kind}",
                f"pipelinerl_{name} {float(value)}"]
    return "\n".join(out) + "\n"


def _error(status: int, type: str, message: str, field: str | None = None) -> JSONResponse:
    body = {"error": {"type": type, "message": message, "field": field}}
    return JSONResponse(body, status_code=status)


def _json(model: BaseModel) -> Response:
    """A model serialized by pydantic-core directly. Returned as a model, FastAPI would validate it against
    the response model again and encode it through `jsonable_encoder`: per generate request, CPU time the
    server's one thread takes from the engine thread."""
    return Response(model.model_dump_json(), media_type="application/json")


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


_ERRORS = {400: {"model": ErrorResponse, "description": "bad input; `error.field` names the offending field"},
           409: {"model": ErrorResponse, "description": "refused in the engine's current state"},
           500: {"model": ErrorResponse, "description": "engine fault"}}


def create_app(backend: EngineBackend | None, title: str = "pipelinerl inference contract") -> FastAPI:
    app = FastAPI(title=title, version=CONTRACT_VERSION,
                  description="Generation with per-token log-probs and weight versions, and in-flight weight "
                              "updates over a torch.distributed broadcast. See contracts/README.md.")

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = _field_of(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            msg = "unknown field"
        return _error(400, "invalid_request", f"{field}: {msg}", field)

    @app.exception_handler(ContractError)
    async def _on_contract_error(_: Request, exc: ContractError) -> JSONResponse:
        return _error(exc.status, exc.type, exc.message, exc.field)

    @app.exception_handler(Exception)
    async def _on_fault(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, "engine_error", f"{type(exc).__name__}: {exc}")

    def need() -> EngineBackend:
        if backend is None:
            raise ContractError(501, "no engine behind this app", type="not_implemented")
        return backend

    @app.post("/v1/generate", response_model=GenerateResponse, responses=_ERRORS, tags=["generation"])
    async def generate(req: GenerateRequest) -> Response:
        """Generate `n` completions of a tokenized prompt, with per-token log-probs and weight versions."""
        return _json(await need().generate(req))

    @app.post("/v1/completions", response_model=CompletionsResponse, responses=_ERRORS, tags=["generation"])
    async def completions(req: CompletionsRequest) -> CompletionsResponse:
        """OpenAI-style text completions, for standard clients and evaluation tools."""
        return await need().completions(req)

    @app.post("/v1/abort", response_model=AbortResponse, responses=_ERRORS, tags=["generation"])
    async def abort(req: AbortRequest) -> AbortResponse:
        """Abort one request, or all; aborted requests return what they generated with finish reason abort."""
        return AbortResponse(aborted=await need().abort(req.request_id))

    @app.post("/v1/weights/init_group", response_model=HealthResponse, responses=_ERRORS, tags=["weights"])
    async def init_weight_update_group(req: InitWeightUpdateGroupRequest) -> HealthResponse:
        """Join the trainer's weight-update group (returns once the group is formed)."""
        await need().init_weight_update_group(req)
        return HealthResponse()

    @app.post("/v1/weights/update", response_model=UpdateWeightsResponse, responses=_ERRORS, tags=["weights"])
    async def update_weights(req: UpdateWeightsRequest) -> Response:
        """Receive a broadcast of new weights and switch to them in flight (see UpdateWeightsRequest)."""
        return _json(await need().update_weights(req))

    @app.get("/v1/weights/checksum", response_model=WeightsChecksumResponse, responses=_ERRORS, tags=["weights"])
    async def weights_checksum() -> WeightsChecksumResponse:
        """Per-parameter sha256 of the weights in use (optional for engines: 501 when not implemented)."""
        return await need().weights_checksum()

    @app.get("/v1/health", response_model=HealthResponse, tags=["status"])
    async def health() -> HealthResponse:
        need()
        return HealthResponse()

    @app.get("/v1/info", response_model=InfoResponse, tags=["status"])
    async def info() -> InfoResponse:
        return need().info()

    @app.get("/metrics", response_class=PlainTextResponse, tags=["status"])
    async def metrics() -> str:
        """Prometheus text format."""
        return need().metrics_text()

    return app
