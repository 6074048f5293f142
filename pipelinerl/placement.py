"""Where the processes of a run go: which node, which GPUs, which port.

A run spans `WORLD_SIZE` nodes (1 unless the environment says otherwise; `RANK` is this node, `MASTER_ADDR`
and `MASTER_PORT` reach node 0). The trainer runs on the first `trainer.num_nodes` nodes, an equal share of its
`trainer.num_processes` processes on the first GPUs of each (global rank 0, on node 0, alone talks to the engines);
node 0 also runs the actor and the reward pool. Every node runs engines on the GPUs left, `engine.tensor_parallel_size`
GPUs each; with `engine.colocate_with_trainer`, the trainer nodes' engines share the trainer's GPUs instead (one
engine per trainer GPU, so one GPU each). On a machine without GPUs the roles share the cores through their thread
counts (`engine.threads`, `trainer.threads`).

Planning is pure (a config, a node and a GPU count in, a plan out) so every placement rule is tested without
the hardware; the launcher applies the plan through each child's environment (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pipelinerl.auth import is_loopback
from pipelinerl.config import ConfigError, RunConfig

DEFAULT_MASTER_PORT = 29500  # torchrun's default, so environments set up for torchrun work unchanged


@dataclass(frozen=True)
class NodeEnv:
    """This node's place in the run, from the standard environment variables."""

    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def multi_node(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> NodeEnv:
        def integer(name: str, default: int) -> int:
            raw = environ.get(name, "")
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"environment {name}={raw!r}: must be an integer") from None

        world, rank = integer("WORLD_SIZE", 1), integer("RANK", 0)
        if world < 1:
            raise ConfigError(f"environment WORLD_SIZE={world}: must be at least 1")
        if not 0 <= rank < world:
            raise ConfigError(f"environment RANK={rank}: must be in [0, WORLD_SIZE={world})")
        master = environ.get("MASTER_ADDR", "")
        if world > 1 and not master:
            raise ConfigError(f"environment MASTER_ADDR is not set: a run over WORLD_SIZE={world} nodes needs "
                              "node 0's address in MASTER_ADDR on every node")
        return cls(world, rank, master or "127.0.0.1", integer("MASTER_PORT", DEFAULT_MASTER_PORT))


@dataclass(frozen=True)
class EngineSlot:
    index: int  # engine number on this node
    # device indices as this node's launcher sees them, engine.tensor_parallel_size of them; empty on CPU
    gpus: tuple[int, ...]
    port: int  # 0: the engine binds a free port and reports it

    def env(self, visible: str | None = None) -> dict[str, str]:
        return gpu_env(self.gpus, visible)


@dataclass(frozen=True)
class NodePlan:
    node: NodeEnv
    engines: tuple[EngineSlot, ...]
    runs_trainer: bool  # this node runs trainer processes (nodes 0 .. trainer.num_nodes-1)
    trainer_gpus: tuple[int, ...]  # empty on CPU
    trainer_processes: int = 0  # this node's share of trainer.num_processes
    trainer_nodes: int = 1  # trainer.num_nodes

    @property
    def main(self) -> bool:
        """Node 0: the trainer's global rank 0, the actor and the reward pool."""
        return self.node.rank == 0

    @property
    def first_trainer_rank(self) -> int:
        """The global rank of this node's first trainer process (every trainer node has the same share)."""
        return self.node.rank * self.trainer_processes

    @property
    def trainer_ranks(self) -> str:
        """This node's trainer ranks in words: "rank 4", "ranks 4-7"."""
        first, last = self.first_trainer_rank, self.first_trainer_rank + self.trainer_processes - 1
        return f"ranks {first}-{last}" if last > first else f"rank {first}"

    def describe(self) -> str:
        where = f"node {self.node.rank} of {self.node.world_size}"
        parts = []
        if self.runs_trainer:
            trainer = f"trainer {self.trainer_ranks}" if self.trainer_nodes > 1 else "trainer"
            parts.append(f"{trainer} on GPUs {_ids(self.trainer_gpus)}" if self.trainer_gpus else f"{trainer} on CPU")
        for e in self.engines:
            parts.append(f"engine{e.index} on GPUs {_ids(e.gpus)}" if e.gpus else f"engine{e.index} on CPU")
        return f"{where}: {'; '.join(parts) or 'nothing'}"


def _ids(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


def gpu_env(gpus: tuple[int, ...], visible: str | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a child given GPU indices as the launcher sees them. When the launcher itself was
    restricted (`visible`, its own CUDA_VISIBLE_DEVICES), index i means the i-th device of that list."""
    if not gpus:
        return {}
    listed = [d.strip() for d in visible.split(",")] if visible else None
    return {"CUDA_VISIBLE_DEVICES": ",".join(listed[g] if listed else str(g) for g in gpus)}


def plan_node(cfg: RunConfig, node: NodeEnv, num_gpus: int) -> NodePlan:
    """This node's share of the run. Raises ConfigError naming the key when the recipe does not fit."""
    e, t = cfg.engine, cfg.trainer
    tp = e.tensor_parallel_size
    if t.num_nodes > node.world_size:
        raise ConfigError(f"trainer.num_nodes: the trainer spans {t.num_nodes} nodes, but the run has "
                          f"{node.world_size} (WORLD_SIZE, or --nodes of `pipelinerl plan`); run it on at least "
                          f"{t.num_nodes} nodes or lower trainer.num_nodes")
    if e.colocate_with_trainer and tp > 1:
        # a colocated engine takes one trainer GPU; spreading one over several would put several of its workers'
        # memory on every trainer GPU for no gain on the one-GPU machines colocation is for
        raise ConfigError(f"engine.tensor_parallel_size: {tp} GPUs per engine, but colocated engines "
                          "(engine.colocate_with_trainer) run one per trainer GPU; set engine.tensor_parallel_size=1 "
                          "or give the engines GPUs of their own")
    runs_trainer = node.rank < t.num_nodes
    share = t.num_processes // t.num_nodes if runs_trainer else 0
    trainer_gpus: tuple[int, ...] = ()
    if num_gpus == 0:
        if e.num_engines == 0:
            raise ConfigError("engine.num_engines: 0 fills the node's free GPUs, but this node has none; "
                              "set the number of engines")
        slots = tuple(EngineSlot(i, (), _port(e.base_port, i)) for i in range(e.num_engines))
    else:
        free = list(range(num_gpus))
        if runs_trainer:
            if share > num_gpus:
                where = "node 0" if t.num_nodes == 1 else f"each of the trainer.num_nodes {t.num_nodes} nodes"
                raise ConfigError(f"trainer.num_processes: {share} trainer processes need as many GPUs on {where}, "
                                  f"which has {num_gpus}" + (" (the trainer runs on one node: trainer.num_nodes 1)"
                                                             if t.num_nodes == 1 else ""))
            trainer_gpus, free = tuple(free[:share]), free[share:]
        if e.colocate_with_trainer and runs_trainer:
            # engines share the trainer's GPUs (one-GPU workstations): one engine per trainer GPU at most
            free = list(trainer_gpus)
        after = f" after the trainer's {len(trainer_gpus)}" if trainer_gpus and not e.colocate_with_trainer else ""
        if e.num_engines:
            count = e.num_engines
            if count * tp > len(free):
                each = "a GPU each" if tp == 1 else f"{tp} GPUs each (engine.tensor_parallel_size)"
                raise ConfigError(f"engine.num_engines: {count} engines need {each}; node {node.rank} has "
                                  f"{len(free)} left of {num_gpus}{after}")
        else:
            count = len(free) // tp
            if len(free) % tp:
                raise ConfigError(f"engine.tensor_parallel_size: engines of {tp} GPUs do not divide the {len(free)} "
                                  f"GPUs left on node {node.rank} (of {num_gpus}{after}), and engine.num_engines 0 "
                                  "gives every free GPU to an engine; change engine.tensor_parallel_size or "
                                  "trainer.num_processes, or set engine.num_engines to leave GPUs idle")
        slots = tuple(EngineSlot(i, tuple(free[i * tp:(i + 1) * tp]), _port(e.base_port, i)) for i in range(count))
    if not slots and not node.multi_node:
        raise ConfigError("engine.num_engines: no GPU is left for an engine after the trainer's "
                          f"{t.num_processes}; lower trainer.num_processes or run on more nodes")
    if node.rank > 0 and is_loopback(e.host) and not is_loopback(node.master_addr):
        raise ConfigError(f"engine.host: {e.host} is reachable only from this node, but node 0 "
                          f"(MASTER_ADDR={node.master_addr}) must reach every engine; set engine.host=0.0.0.0 "
                          "or this node's address")
    return NodePlan(node, slots, runs_trainer, trainer_gpus, share, t.num_nodes)


def _port(base: int, index: int) -> int:
    return base + index if base else 0


def advertised_host(bind_host: str, master_addr: str, master_port: int) -> str:
    """The address other nodes use to reach a server bound to `bind_host` on this node: the bind address itself
    unless it is a wildcard, else this node's address on the route to node 0."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    if is_loopback(master_addr):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))  # UDP: no packet is sent; the kernel only picks the route
        return s.getsockname()[0]


# Device files a GPU driver makes: NVIDIA's (also in containers given GPUs), AMD ROCm's, and WSL2's GPU bridge.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def _driver_present() -> bool:
    return any(os.path.exists(f) for f in GPU_DEVICE_FILES) or shutil.which("nvidia-smi") is not None


def detect_gpus() -> int:
    """GPUs this process can use (honours CUDA_VISIBLE_DEVICES); 0 without CUDA.

    Where no GPU driver is there to ask (no device file, no nvidia-smi), 0 without importing torch: the launcher
    asks before it starts any role, and torch's import (about 1 s on a small CPU) would delay every role's start
    by as much."""
    if not _driver_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install: run on CPU rather than not at all
        return 0


def listed_gpus(timeout_s: float = 15.0) -> int:
    """GPUs the driver lists (`nvidia-smi -L`), whatever torch makes of them; 0 without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def why_no_gpus(found: int) -> str:
    """Why torch finds `found` GPUs where the driver lists more, in words (empty when they agree): a CPU build of
    torch (a venv made on a machine without GPUs), or CUDA_VISIBLE_DEVICES."""
    listed = listed_gpus()
    if listed <= found:
        return ""
    try:
        import importlib.metadata

        import torch

        version, cuda = importlib.metadata.version("torch"), torch.version.cuda
    except Exception as e:  # noqa: BLE001 (a broken install is itself the answer)
        return f"nvidia-smi lists {listed} GPUs, but torch does not load here ({e})"
    if cuda is None:
        return (f"nvidia-smi lists {listed} GPUs, but torch {version} in {sys.prefix} is a CPU build (a venv made on a "
                "machine without GPUs); rebuild it here: make clean && make install")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"nvidia-smi lists {listed} GPUs; CUDA_VISIBLE_DEVICES={visible!r} leaves torch {found}"
    return f"nvidia-smi lists {listed} GPUs, but torch {version} (CUDA {cuda}) can use {found}; see `nvidia-smi`"
