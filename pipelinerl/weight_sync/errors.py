"""The errors of the weight-update group, raised while forming it (`group`) and when a transfer fails
(`transfer`); `_as_sync_error` turns torch's error into one, a timeout when torch's text says it timed out.
A module of their own because both of those raise them and `transfer` imports nothing of `group` at run time."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """The weight-update group could not be formed or a transfer failed."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not join (or did not take part in a transfer) within the timeout."""


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _as_sync_error(e: Exception, what: str, timeout_s: float, hint: str = "") -> WeightSyncError:
    text = _first_line(e)
    hint = f"; {hint}" if hint else ""
    if "timeout" in text.lower() or "timed out" in text.lower():
        return WeightSyncTimeout(f"{what} within {timeout_s:g}s: {text}{hint}")
    return WeightSyncError(f"{what}: {text}{hint}")
