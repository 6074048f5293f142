"""The contract's conformance suite. The code lives in `pipelinerl/conformance.py` so that it is importable from
the installed package and runnable as `pipelinerl conformance`; this re-exports it for use from a checkout."""

from pipelinerl.conformance import FAIL, PASS, SKIP, Result, Settings, Suite, format_table, run_suite

__all__ = ["FAIL", "PASS", "SKIP", "Result", "Settings", "Suite", "format_table", "run_suite"]
