"""The HTTP front of every engine: routes of the inference contract wired to an `EngineBackend`.

An engine (the embedded one, the vLLM adapter, ...) implements `EngineBackend`; `create_app` turns it into a
FastAPI app with the contract's routes, error format and status codes. The OpenAPI document of the contract is
generated from `create_app(None)`, so routes and models cannot drift apart.

Every error, of every route and of routing itself (404, 405), is the contract's envelope (`error_response`);
`install_error_handlers` sets that up. Middleware (authentication, say) goes in through `create_app(middleware=)`
and answers its own errors with `error_response`: it runs outside the exception handlers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

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


def error_response(status: int, type: str, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The contract's error envelope, `{"error": {"type", "message", "field"}}`: what every error of every route
    returns. Middleware that answers for itself (authentication, say) should answer with this too."""
    body = {"error": {"type": type, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=headers)


def _json(model: BaseModel) -> Response:
    """A model serialized by pydantic-core directly. Returned as a model, FastAPI would validate it against
    the response model again and encode it through `jsonable_encoder`: per generate request, CPU time the
    server's one thread takes from the engine thread."""
    return Response(model.model_dump_json(), media_type="application/json")


# pydantic names the member of a union that failed (`prompt: str | list[str]`) in the error's location: "str",
# "list[constrained-str]", "function-after[...]", ... No field of the contract is named like that.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none)$|[\[\]'-]")


def _field_of(loc: tuple, kind: str | None = None) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    if kind != "extra_forbidden":  # there the last part is the client's unknown field, whatever its name
        parts = [p for p in parts if not _UNION_MEMBER.search(p)]
    return ".".join(parts) or "body"


def _validation_error(exc: RequestValidationError, content_type: str) -> tuple[str, str]:
    """(field, message) of a problem pydantic or FastAPI found in a request. Of a union's members, the one that
    came closest names it: the deepest problem (`prompt: [1]` is `prompt.0: should be a string`, not `prompt:
    should be a string`), else one in a member of the right type (`prompt: []` is too short, not "not a string")."""
    errors = exc.errors()
    closest = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")),
                  default=None)
    problem = closest or {"loc": (), "msg": "invalid request"}
    loc, kind = tuple(problem.get("loc", ())), problem.get("type")
    if kind == "json_invalid":  # loc is ("body", character offset)
        reason = (problem.get("ctx") or {}).get("error") or "not JSON"
        return "body", f"body: invalid JSON ({reason} at character {loc[-1] if loc else 0})"
    field = _field_of(loc, kind)
    if field == "body" and kind in ("model_attributes_type", "dict_type", "missing"):
        # FastAPI hands a body that is not a JSON object (an array, a string, nothing) to the model as it is, and
        # one without a JSON content type as bytes
        hint = "" if "json" in content_type else (
            f" (Content-Type {content_type}: send application/json)" if content_type else
            " (no Content-Type: send application/json)")
        return field, f"body: must be a JSON object{hint}"
    message = "unknown field" if kind == "extra_forbidden" else problem.get("msg", "invalid value")
    return field, f"{field}: {message}"


# error types of the HTTP errors that routing, body parsing and dependencies raise (starlette's HTTPException)
_HTTP_ERROR_TYPES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                     405: "method_not_allowed", 413: "too_large", 415: "unsupported_media_type"}


def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` returns in the contract's envelope, with a 4xx for bad input: pydantic's and FastAPI's
    validation errors (400, naming the field), starlette's HTTP errors (an unknown route's 404, a wrong method's
    405, a body FastAPI could not parse), the engines' `ContractError`s, and anything else as a 500."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        field, message = _validation_error(exc, request.headers.get("content-type", ""))
        return error_response(400, "invalid_request", message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code < 200 or exc.status_code in (204, 304):  # no body allowed
            return Response(status_code=exc.status_code, headers=exc.headers)
        kind = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "server_error")
        if exc.status_code == 404:
            message = f"no route {request.url.path}; see the contract (GET /openapi.json)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow")
            message = f"{request.method} {request.url.path}: method not allowed" + (f" (allowed: {allowed})"
                                                                                     if allowed else "")
        elif exc.status_code == 400:  # the only HTTP error about the request's content: FastAPI could not read the body
            message = f"body: {exc.detail}"
        else:
            message = str(exc.detail)
        field = "body" if exc.status_code == 400 else None
        return error_response(exc.status_code, kind, message, field, headers=exc.headers)

    @app.exception_handler(ContractError)
    async def _on_contract_error(_: Request, exc: ContractError) -> JSONResponse:
        return error_response(exc.status, exc.type, exc.message, exc.field)

    @app.exception_handler(Exception)
    async def _on_fault(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, "engine_error", f"{type(exc).__name__}: {exc}")


def _error_doc(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


# The error statuses each route documents. "4XX" also keeps FastAPI from documenting its own 422 (and its
# `HTTPValidationError` body), which these routes never return: bad input is a 400 in the contract's envelope.
_ERRORS: dict[int | str, dict] = {
    400: _error_doc("bad input; `error.field` names the offending field"),
    409: _error_doc("refused in the engine's current state"),
    "4XX": _error_doc("other client errors (a body FastAPI could not read, ...)"),
    500: _error_doc("engine fault"),
}
_WEIGHT_ERRORS = {**_ERRORS, 504: _error_doc("the weight transfer failed or timed out: a member of the group "
                                             "never joined, went away, or its address could not be reached")}
_OPTIONAL_ERRORS = {**_ERRORS, 501: _error_doc("not implemented by this engine")}


def create_app(backend: EngineBackend | None, title: str = "pipelinerl inference contract",
               middleware: Sequence[Middleware] = ()) -> FastAPI:
    """The contract's routes over `backend` (None: the routes answer 501; the OpenAPI document is made from it).
    `middleware` wraps every route, outermost first (starlette's `Middleware(cls, ...)`); an error it returns
    itself should be an `error_response`."""
    app = FastAPI(title=title, version=CONTRACT_VERSION, middleware=list(middleware),
                  description="Generation with per-token log-probs and weight versions, and in-flight weight "
                              "updates over a torch.distributed broadcast. See contracts/README.md.")
    install_error_handlers(app)

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

    @app.post("/v1/weights/init_group", response_model=HealthResponse, responses=_WEIGHT_ERRORS, tags=["weights"])
    async def init_weight_update_group(req: InitWeightUpdateGroupRequest) -> HealthResponse:
        """Join the trainer's weight-update group (returns once the group is formed)."""
        await need().init_weight_update_group(req)
        return HealthResponse()

    @app.post("/v1/weights/update", response_model=UpdateWeightsResponse, responses=_WEIGHT_ERRORS,
              tags=["weights"])
    async def update_weights(req: UpdateWeightsRequest) -> Response:
        """Receive a broadcast of new weights and switch to them in flight (see UpdateWeightsRequest)."""
        return _json(await need().update_weights(req))

    @app.get("/v1/weights/checksum", response_model=WeightsChecksumResponse, responses=_OPTIONAL_ERRORS,
             tags=["weights"])
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
