"""Generate the contract's OpenAPI document: `python -m pipelinerl.contracts.openapi > contracts/openapi.json`."""

from __future__ import annotations

import json
from typing import Any


def build_openapi() -> dict[str, Any]:
    from pipelinerl.contracts.routes import create_app

    return create_app(None).openapi()


def render_openapi() -> str:
    return json.dumps(build_openapi(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render_openapi(), end="")
