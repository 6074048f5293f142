import contextlib
import subprocess
from pathlib import Path

import pytest

from pipelinerl.engines.client import EngineClient
from pipelinerl.models.tiny import build_tiny_model
from pipelinerl.procs import engine_command, free_port, start_process, stop_process, tail


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with sharp (non-uniform) next-token distributions, so greedy ties are unlikely."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2,
                            initializer_range=0.2, seed=1234)


@contextlib.contextmanager
def running_engine(model_dir, log_dir: Path, extra=(), threads: int = 1):
    port = free_port()
    log = log_dir / f"engine-{port}.log"
    proc: subprocess.Popen = start_process(engine_command(str(model_dir), port, extra=list(extra)), log,
                                           threads=threads)
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        try:
            client.wait_healthy(timeout_s=120, process=proc)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- engine log ---\n{tail(log)}") from e
        client.log_path = log
        client.process = proc
        yield client
    finally:
        client.close()
        stop_process(proc)
