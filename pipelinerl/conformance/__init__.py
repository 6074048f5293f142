"""The inference contract's conformance suite: checks any engine's URL against `contracts/README.md`.

`pipelinerl conformance --url http://127.0.0.1:8100 --model PATH` runs every check and prints a PASS/FAIL
table (exit status 1 on any failure). PATH is a local copy of the model the engine serves: this process acts
as the trainer (rank 0 of a gloo weight-update group, pushing the same weights and changed ones) and rescores
the engine's tokens with it, so log-probs and in-flight switches are checked against an independent
computation rather than against the engine itself. What the checks expect holds for any causal LM: changed
weights negate the logits (so every greedy token changes, even for a model that repeats one token), and
samples are drawn at a temperature at which this model's samples differ.

The suite changes the engine's weights while it runs and pushes the original weights back at the end (the
engine's weight version ends higher than it started). It leaves the engine in this process's weight-update
group; a trainer that calls `init_group` afterwards replaces it.

The package: `runner` (the `Suite`, its settings and results table, the command line), `reference` (the local
model, the weights pushed and the rescoring), `generation` (the checks that leave the weights alone) and
`weight_updates` (the checks that join the weight-update group and change the weights); `outcomes` is what they
share (PASS, FAIL, SKIP and how a check raises them).
"""

from pipelinerl.conformance.outcomes import FAIL, PASS, SKIP, CheckFailed, Result, Skipped, expect
from pipelinerl.conformance.reference import Reference, mismatch
from pipelinerl.conformance.runner import Settings, Suite, add_arguments, format_table, main, run_suite

__all__ = [
    "FAIL", "PASS", "SKIP", "CheckFailed", "Reference", "Result", "Settings", "Skipped", "Suite", "add_arguments",
    "expect", "format_table", "main", "mismatch", "run_suite",
]
