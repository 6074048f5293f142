"""How the trainer's state is split over its ranks (DDP, DeepSpeed ZeRO 0-3, FSDP, CPU offload), read from
`trainer.accelerate_config` and the DeepSpeed JSON it names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Sharding:
    kind: str  # none | ddp | zero0 | zero1 | zero2 | zero3 | fsdp
    ranks: int
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False  # FSDP's own (fsdp_activation_checkpointing)
    source: str = ""

    @property
    def deepspeed(self) -> bool:
        return self.kind.startswith("zero")

    @property
    def divides(self) -> tuple[bool, bool, bool]:
        """Whether (parameters, gradients, optimizer state) are divided among the ranks."""
        stage = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(self.kind, 0)
        return stage >= 3, stage >= 2, stage >= 1

    def describe(self) -> str:
        what = {"none": "one process, no sharding", "ddp": f"DDP, {self.ranks} replicas",
                "fsdp": f"FSDP full shard over {self.ranks} GPUs"}.get(self.kind)
        if what is None:
            what = f"DeepSpeed ZeRO-{self.kind[-1]} over {self.ranks} GPU{'s' if self.ranks > 1 else ''}"
        off = [name for name, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params)) if on]
        if off:
            what += f", {' and '.join(off)} offloaded to CPU"
        return what + (f" ({self.source})" if self.source else "")


def _read_yaml(path: Path, key: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} is not a YAML mapping")
    return data


def _find(name: str, near: Path) -> Path | None:
    """A path named in a config file: relative to the working directory (as the launcher resolves it), or to
    a directory above the file that names it (configs/deepspeed/... from configs/accelerate/...)."""
    for base in (Path.cwd(), *near.resolve().parents):
        if (base / name).is_file():
            return base / name
    return None


def _offloaded(device: Any) -> bool:
    return str(device or "none").lower() in ("cpu", "nvme")


def detect_sharding(cfg: RunConfig) -> Sharding:
    """How the trainer's state is split, from `trainer.accelerate_config` (and the DeepSpeed JSON it names)."""
    t = cfg.trainer
    n = t.num_processes
    plain = Sharding("ddp" if n > 1 else "none", n)
    if not t.accelerate_config:
        return plain
    path = Path(t.accelerate_config)
    y = _read_yaml(path, "trainer.accelerate_config")
    kind = str(y.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        ds = y.get("deepspeed_config") or {}
        stage = ds.get("zero_stage", 0)
        off_opt, off_par = ds.get("offload_optimizer_device"), ds.get("offload_param_device")
        source = str(path)
        if ds.get("deepspeed_config_file"):
            found = _find(str(ds["deepspeed_config_file"]), path)
            if found is None:
                raise ConfigError(f"trainer.accelerate_config: {path} names the DeepSpeed config "
                                  f"{ds['deepspeed_config_file']!r}, which does not exist")
            try:
                zero = json.loads(found.read_text()).get("zero_optimization") or {}
            except (OSError, ValueError) as e:
                raise ConfigError(f"trainer.accelerate_config: cannot read {found}: {e}") from None
            stage = zero.get("stage", 0)
            off_opt = (zero.get("offload_optimizer") or {}).get("device")
            off_par = (zero.get("offload_param") or {}).get("device")
            source = f"{path} -> {ds['deepspeed_config_file']}"
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"trainer.accelerate_config: {source}: ZeRO stage {stage!r} is not 0-3")
        return Sharding(f"zero{stage}", n, _offloaded(off_opt), _offloaded(off_par) and stage == 3, source=source)
    if kind == "FSDP":
        f = y.get("fsdp_config") or {}
        if str(f.get("fsdp_sharding_strategy", "FULL_SHARD")).upper() in ("NO_SHARD", "3"):
            return dataclasses.replace(plain, source=str(path))
        offload = bool(f.get("fsdp_offload_params"))
        return Sharding("fsdp", n, offload, offload, bool(f.get("fsdp_activation_checkpointing")), str(path))
    return dataclasses.replace(plain, source=str(path))
