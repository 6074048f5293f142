"""The API key that guards an engine's routes.

Every engine route except `/v1/health` needs `Authorization: Bearer <key>` when the engine has a key. Where the
key comes from, first found wins: `--api-key-file PATH` of `pipelinerl serve`; the environment variable
`PIPELINERL_API_KEY`; for a run, `RUN_DIR/api_key`, which the launcher writes once per run (mode 0600) and hands to
every process it starts (engines, trainer, actor) through that variable. Clients (the trainer's, the actor's,
`pipelinerl eval` and the conformance suite) send the key from the same variable. The key is never printed or
logged, and never written into `RUN_DIR/config.yaml`.

An engine bound to an address other hosts can reach (anything but loopback) refuses to start without a key,
unless told `--allow-unauthenticated`: anyone who can reach it could otherwise replace its weights, point it at a
process group of their choosing, or abort its requests. (A run's engines always have the run's key.)
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

API_KEY_ENV = "PIPELINERL_API_KEY"
KEY_FILE = "api_key"
OPEN_PATHS = frozenset({"/v1/health"})  # what a load balancer or a launcher polls before it has the key


def read_key_file(path: str | os.PathLike) -> str:
    """The key in a file (surrounding whitespace dropped); an empty or unreadable file is an error naming it."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"API key file {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def api_key_from_env(environ: dict[str, str] | None = None) -> str | None:
    key = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    return key or None


def run_api_key(run_dir: str | os.PathLike) -> str:
    """The run's key: `PIPELINERL_API_KEY` if set, else `RUN_DIR/api_key`, made (random, mode 0600) on first use
    so that a resumed run, and engine nodes sharing the run directory, use the same one."""
    key = api_key_from_env()
    if key:
        return key
    path = Path(run_dir) / KEY_FILE
    if path.exists():
        return read_key_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries the key (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def is_loopback(host: str) -> bool:
    """Whether `host` is an address only this machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse to serve on an address other hosts can reach without a key, unless explicitly allowed."""
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise SystemExit(f"refusing to serve on {host} without an API key: any host that reaches it could replace the "
                     f"weights. Set {API_KEY_ENV} or --api-key-file, bind to 127.0.0.1, or pass "
                     "--allow-unauthenticated on a trusted network.")


class ApiKeyMiddleware:
    """ASGI middleware: a request to any path but `/v1/health` without `Authorization: Bearer <key>` gets 401 in
    the contract's error envelope. (Plain ASGI, not BaseHTTPMiddleware: no extra task per request.)"""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            if not authorized(header.decode("latin-1") if header else None, self.api_key):
                from fastapi.responses import JSONResponse

                message = ("missing or wrong API key: send `Authorization: Bearer <key>` (the run's key is in "
                           f"RUN_DIR/{KEY_FILE}; clients read it from {API_KEY_ENV})")
                body = {"error": {"type": "unauthorized", "message": message, "field": "authorization"}}
                response = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve_api_key(api_key_file: str | None, host: str, allow_unauthenticated: bool) -> str | None:
    """`pipelinerl serve`'s key: from --api-key-file, else the environment; refuses a reachable bind without one."""
    key = read_key_file(api_key_file) if api_key_file else api_key_from_env()
    check_bind(host, key, allow_unauthenticated)
    return key
