"""The embedded engine (pipelinerl's own, in this package) as an engine kind."""

from pipelinerl.engines.kind import EngineKind

KIND = EngineKind(name="embedded", serve="pipelinerl.engines.embedded.serve:serve")
