"""The trainer role: `Trainer` (implements `pipelinerl.contracts.trainer.TrainerBackend` on accelerate),
batch packing, the optimizer and schedule, checkpoints and Hugging Face export."""

from pipelinerl.trainer.batch import (
    MicroBatch,
    Minibatch,
    StepBatch,
    build_step,
    group_advantages,
    sample_advantages,
    set_sample_advantages,
    validate_samples,
)
from pipelinerl.trainer.checkpoint import (
    checkpoint_dir,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from pipelinerl.trainer.optim import build_optimizer, build_scheduler, lr_factor
from pipelinerl.trainer.publisher import WeightPublisher, clean_name
from pipelinerl.trainer.trainer import Trainer, make_accelerator

__all__ = [
    "MicroBatch",
    "Minibatch",
    "StepBatch",
    "Trainer",
    "build_optimizer",
    "build_scheduler",
    "build_step",
    "checkpoint_dir",
    "clean_name",
    "export_hf",
    "group_advantages",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_factor",
    "make_accelerator",
    "sample_advantages",
    "save_checkpoint",
    "set_sample_advantages",
    "WeightPublisher",
    "validate_samples",
]
