"""GPU defaults decided at launch (`config.resolve_for_machine`, a pure function given the node's GPU count) and
how the trainer processes are told to end on an NCCL failure (`train.nccl_failure_env`). No GPU needed: the GPU
count is an argument."""

from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config, resolve_for_machine
from pipelinerl.train import nccl_failure_env

REPO = Path(__file__).resolve().parents[1]
BASE = ["run_dir=/tmp/run", "model.path=/tmp/model"]


def test_a_run_config_leaves_dtype_and_backend_to_the_machine():
    cfg = load_config(None, BASE)
    assert (cfg.model.dtype, cfg.weight_sync.backend) == ("auto", "auto")


@pytest.mark.parametrize(("gpus", "overrides", "dtype", "backend"), [
    (0, [], "float32", "gloo"),  # a laptop
    (8, [], "bfloat16", "nccl"),  # a GPU node
    (1, ["engine.colocate_with_trainer=true"], "bfloat16", "gloo"),  # engines on the trainer's GPU: no NCCL
    (8, ["model.dtype=float32", "weight_sync.backend=nccl"], "float32", "nccl"),  # explicit values stay
])
def test_auto_settings_follow_the_gpus_found(gpus, overrides, dtype, backend):
    cfg, notes = resolve_for_machine(load_config(None, BASE + overrides), gpus)
    assert (cfg.model.dtype, cfg.weight_sync.backend) == (dtype, backend)
    assert notes == []


def test_explicit_gloo_on_a_gpu_node_is_kept_and_said_to_be_slower():
    cfg, notes = resolve_for_machine(load_config(REPO / "recipes" / "tiny_cpu.yaml"), 4)
    assert cfg.weight_sync.backend == "gloo" and cfg.model.dtype == "bfloat16"
    assert len(notes) == 1 and "weight_sync.backend=gloo" in notes[0] and "slower" in notes[0], notes
    # colocated engines need it: said so, not suggested otherwise
    cfg, notes = resolve_for_machine(load_config(REPO / "recipes" / "orz_1gpu.yaml"), 1)
    assert cfg.weight_sync.backend == "gloo" and "colocate_with_trainer" in notes[0], notes
    # on a CPU node gloo is the only choice and nothing is said
    assert resolve_for_machine(load_config(REPO / "recipes" / "tiny_cpu.yaml"), 0)[1] == []


def test_nccl_without_gpus_fails_naming_the_key():
    with pytest.raises(ConfigError, match="weight_sync.backend: nccl needs GPUs"):
        resolve_for_machine(load_config(None, BASE + ["weight_sync.backend=nccl"]), 0)


def test_resolved_settings_are_checked_like_any_config():
    # a recipe that states its GPUs may leave the backend auto (nccl once resolved); the GPU recipes resolve as set
    cfg, _ = resolve_for_machine(load_config(None, BASE + ["resources.gpus_per_node=8"]), 8)
    assert cfg.weight_sync.backend == "nccl"
    cfg, _ = resolve_for_machine(load_config(REPO / "recipes" / "orz_7b.yaml"), 8)
    assert (cfg.model.dtype, cfg.weight_sync.backend) == ("bfloat16", "nccl")
    # engines on the trainer's GPUs with auto resolve to gloo, which the checks then accept; nccl they refuse
    colocated = BASE + ["resources.gpus_per_node=1", "engine.colocate_with_trainer=true"]
    assert resolve_for_machine(load_config(None, colocated), 1)[0].weight_sync.backend == "gloo"
    with pytest.raises(ConfigError, match="weight_sync.backend"):
        load_config(None, colocated + ["weight_sync.backend=nccl"])


def test_trainer_processes_get_nccl_failure_handling_unless_the_user_chose(tmp_path):
    env = nccl_failure_env(tmp_path, {})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == \
        str(tmp_path.resolve() / "logs" / "nccl_trace" / "rank_")
    assert "TORCH_NCCL_BLOCKING_WAIT" not in env
    # a setting the user made under any of its names is left alone, all names included
    mine = nccl_failure_env(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "NCCL_ASYNC_ERROR_HANDLING"} & mine.keys()
    assert mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
