"""What a conformance check ends in (PASS, FAIL or SKIP, with a detail), and how checks read an engine's refusals.

Shared by the runner and both kinds of checks, so that neither imports the other to raise or judge."""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

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


def error_of(r: httpx.Response) -> dict | None:
    """The contract's `error` object of a response, or None where the body has none."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def normalized_field(f: str | None) -> str | None:
    """`prompt_token_ids.1` (pydantic's location) and `prompt_token_ids[1]` name the same field."""
    return re.sub(r"\.(\d+)", r"[\1]", f) if f else f
