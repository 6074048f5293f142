"""The embedded engine (pipelinerl's own, in this package) as an engine kind."""

from pipelinerl.contracts.engine import EngineKind

KIND = EngineKind(name="embedded", serve="pipelinerl.engines.embedded.serve:serve")
