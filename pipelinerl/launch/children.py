"""The launcher's vocabulary for its child processes: one described before it starts (`ProcessSpec`), and the
error that names one that died (`ChildFailed`). Shared by the engine supervisor, the roles and the dry run."""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.procs import start_process


@dataclass(frozen=True)
class ProcessSpec:
    """A child process of the run, before it starts: what `--dry-run` prints and `start_process` starts."""

    name: str
    command: list[str]
    env: dict[str, str]  # set beside the launcher's own environment
    log: Path
    threads: int | None = None

    def start(self) -> subprocess.Popen:
        return start_process(self.command, self.log, threads=self.threads, env=self.env)

    def describe(self) -> str:
        env = dict(self.env)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads))
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        shown = shown or "(the launcher's)"
        return f"{self.name}: {shlex.join(self.command)}\n    env: {shown}\n    log: {self.log}"


class ChildFailed(RuntimeError):
    pass
