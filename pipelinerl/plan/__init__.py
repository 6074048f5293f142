"""`pipelinerl plan RECIPE`: where every process of a recipe goes and the memory each GPU will need, worked out
on any machine (no GPU, no download) from the recipe and the model's shape, with a verdict and the changes that
would make a recipe fit.

Read in this order, each module using only those before it:
- units: bytes, the dtypes' widths, how figures are written
- shapes: the model's shape (config.json, `model.init=tiny`, or Qwen2.5's published configs)
- sharding: how the trainer's state is split (DDP, ZeRO 0-3, FSDP, offload), from `trainer.accelerate_config`
- memory: one trainer rank's and one engine GPU's memory, and the rules behind every figure
- fit: the `Plan` (placement, memory per GPU and per node, problems, warnings) and `make_plan`
- suggestions: the changes that would make a recipe fit, each tried by planning again
- forecast: `--time`, one RL step's and the run's time and cost on an accelerator (published figures, or this
  machine's measured for a CPU recipe), from the plan and stated assumptions
- report: the plan (and the forecast) as text or JSON
- cli: the command line (`pipelinerl plan`)

This module only gathers the names used from outside the package. (`make_plan` imports `suggestions` when it is
called: that module plans variants of the recipe with `fit._plan`. The function `suggestions.suggestions` is not
gathered here, where its name would hide the module of the same name.)
"""

from pipelinerl.plan.cli import add_arguments, check_flags, cluster_of, machine_host_memory_gib, main
from pipelinerl.plan.fit import HOST_PROCESS_GIB, Cluster, GpuUse, Plan, Suggestion, host_memory, make_plan, place
from pipelinerl.plan.forecast import (
    ACCELERATORS,
    GPU_KINDS,
    Accelerator,
    Assumptions,
    Forecast,
    accelerator,
    assumptions,
    default_gpu,
    forecast,
    forecast_to_json,
    probe_cpu,
)
from pipelinerl.plan.memory import (
    ENGINE_OVERHEAD_GIB,
    ENGINE_PREFILL_TOKENS,
    LOGIT_BYTES,
    MIN_SEQUENCES,
    PACK_BUFFERS,
    TRAINER_OVERHEAD_GIB,
    ZERO3_MIN_GATHER,
    EngineMemory,
    Line,
    TrainerMemory,
    _precision,  # launch.py: the trainer's precision, for the checkpoint size
    engine_memory,
    engine_overhead,
    layer_activation_bytes,
    trainer_memory,
)
from pipelinerl.plan.report import format_forecast, format_plan, plan_to_json
from pipelinerl.plan.shapes import (
    QWEN25_CONFIGS,
    ModelShape,
    known_shape,
    model_shape,
    shape_from_hf_config,
    tiny_shape,
)
from pipelinerl.plan.sharding import Sharding, detect_sharding
from pipelinerl.plan.suggestions import minimum_gpu_memory
from pipelinerl.plan.units import DTYPE_BYTES, GIB, MIB

__all__ = [
    "ACCELERATORS",
    "GPU_KINDS",
    "Accelerator",
    "Assumptions",
    "Forecast",
    "accelerator",
    "assumptions",
    "default_gpu",
    "forecast",
    "forecast_to_json",
    "format_forecast",
    "probe_cpu",
    "DTYPE_BYTES",
    "ENGINE_OVERHEAD_GIB",
    "ENGINE_PREFILL_TOKENS",
    "GIB",
    "HOST_PROCESS_GIB",
    "LOGIT_BYTES",
    "MIB",
    "MIN_SEQUENCES",
    "PACK_BUFFERS",
    "QWEN25_CONFIGS",
    "TRAINER_OVERHEAD_GIB",
    "ZERO3_MIN_GATHER",
    "Cluster",
    "EngineMemory",
    "GpuUse",
    "Line",
    "ModelShape",
    "Plan",
    "Sharding",
    "Suggestion",
    "TrainerMemory",
    "_precision",
    "add_arguments",
    "check_flags",
    "cluster_of",
    "detect_sharding",
    "engine_memory",
    "engine_overhead",
    "format_plan",
    "host_memory",
    "known_shape",
    "layer_activation_bytes",
    "machine_host_memory_gib",
    "main",
    "make_plan",
    "minimum_gpu_memory",
    "model_shape",
    "place",
    "plan_to_json",
    "shape_from_hf_config",
    "tiny_shape",
    "trainer_memory",
]
