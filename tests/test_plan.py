"""`pipelinerl plan`: placement and memory per GPU, checked against numbers worked out by hand here from Qwen2.5's
published shapes (not by calling the planner's own helpers)."""

import json
from pathlib import Path

import pytest

from pipelinerl import cli
from pipelinerl.config import ConfigError, load_config
from pipelinerl.plan import (
    GIB,
    MIB,
    Cluster,
    Sharding,
    detect_sharding,
    engine_memory,
    format_plan,
    known_shape,
    make_plan,
    model_shape,
    trainer_memory,
)

REPO = Path(__file__).resolve().parents[1]

# Qwen2.5-7B's published config.json
H, I, L, HEADS, KV, HD, V = 3584, 18944, 28, 28, 4, 128, 152064
# q (+bias), k and v (+biases), o, the MLP's gate/up/down, two RMSNorm gains
LAYER = (H * H + H) + 2 * (H * KV * HD + KV * HD) + H * H + 3 * H * I + 2 * H
N_7B = 2 * V * H + L * LAYER + H  # untied embedding and LM head, final norm


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name configs/accelerate/... relative to the repository


def recipe(name: str, *overrides: str):
    return load_config(REPO / "recipes" / name, list(overrides))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_qwen25_7b_parameter_count():
    assert N_7B == 7_615_616_512  # ~7.62B, as published
    shape = known_shape("Qwen/Qwen2.5-7B")
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.vocab_size) == (H, I, L, HEADS, KV, HD, V)
    assert not shape.tie_word_embeddings
    assert shape.num_params == N_7B
    assert known_shape("Qwen/Qwen2.5-0.5B").num_params == 494_032_768  # tied embeddings, vocab 151936
    assert known_shape("Qwen/Qwen2.5-32B").num_params == 32_763_876_352


def test_parameter_count_matches_transformers_for_an_odd_shape(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=123, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        expected = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    cfg = load_config(None, ["run_dir=/tmp/x", f"model.path={tmp_path}"])
    assert model_shape(cfg).num_params == expected


def test_zero3_trainer_on_four_gpus_by_hand():
    cfg = recipe("orz_7b.yaml", "preset=dapo")  # the policy alone (no critic); the critic's share: the next test
    sharding = detect_sharding(cfg)
    assert sharding == Sharding("zero3", 4, source=sharding.source)
    main = trainer_memory(known_shape("Qwen/Qwen2.5-7B"), cfg, sharding, main=True)
    other = trainer_memory(known_shape("Qwen/Qwen2.5-7B"), cfg, sharding, main=False)
    # DeepSpeed bf16: bf16 parameters 2 B + bf16 gradients 2 B + fp32 master 4 B + AdamW moments 4 B + 4 B,
    # all divided over the 4 ranks
    assert [x.bytes for x in main.state] == [N_7B * 2 // 4, N_7B * 2 // 4, N_7B * 12 // 4]
    assert main.state_bytes == N_7B * 16 // 4 == 30_462_466_048  # 28.4 GiB
    # one micro-batch of 16384 tokens with gradient checkpointing: L + 2 bf16 hidden states per token, and the
    # larger of one recomputed layer and the LM head's chunked logits (12 B per entry of a 1024-token chunk);
    # auto attention on GPUs is flash-attention 2: no dense mask
    T = 16384
    checkpoints = (L + 2) * T * H * 2
    layer = ((8 * H + 3 * KV * HD + 4 * I) * 2 + 16 * H) * T
    logits = 12 * 1024 * V
    gathered = 2 * (V * H) * 2  # ZeRO-3: two embedding-sized units in bf16
    assert layer > logits
    assert main.training_bytes == checkpoints + layer + gathered
    assert main.activations_checkpointed == checkpoints + layer
    # the broadcast: every rank gathers one unit at a time (here the embedding, above the 512 MB bucket, alone);
    # rank 0 also packs into two buffers of that size
    embedding = V * H * 2
    assert embedding > 512 * MIB
    assert main.broadcast_bytes == embedding + 2 * embedding
    assert other.broadcast_bytes == embedding
    assert main.total == N_7B * 16 // 4 + max(main.training_bytes, main.broadcast_bytes) + 3 * GIB
    assert round(main.total / GIB, 1) == 40.8


def test_the_critic_adds_the_base_models_sharded_state():
    """recipes/orz_7b.yaml trains a critic (PPO with GAE, as ORZ): parameters, gradients and optimizer state once
    more, for the base model without its (untied) LM head, sharded as the policy's; its working set comes after
    the policy's, so only the state adds up."""
    shape = known_shape("Qwen/Qwen2.5-7B")
    with_critic = trainer_memory(shape, recipe("orz_7b.yaml"), detect_sharding(recipe("orz_7b.yaml")))
    alone = trainer_memory(shape, recipe("orz_7b.yaml", "preset=dapo"),
                           detect_sharding(recipe("orz_7b.yaml")))
    critic = with_critic.state[-1]
    assert critic.what == "critic" and critic.bytes == int(N_7B * 16 // 4 * (N_7B - V * H) / N_7B)
    assert with_critic.state_bytes == alone.state_bytes + critic.bytes
    assert with_critic.training_bytes == alone.training_bytes
    assert round(with_critic.total / GIB, 1) == 67.1  # of 80: still fits


def test_engine_kv_room_on_an_80_gib_gpu_by_hand():
    cfg = recipe("orz_7b.yaml")
    e = engine_memory(known_shape("Qwen/Qwen2.5-7B"), cfg, 80 * GIB)
    assert e.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    budget = int(0.9 * 80 * GIB)  # engine.gpu_memory_utilization
    weights = N_7B * 2  # bfloat16, the whole model on the engine's GPU
    overhead = 2 * GIB + 8192 * (4 * H + 3 * I) * 2 + 512 * V * 8  # context, prefill chunk, sampler (512 seqs)
    tokens = (budget - weights - overhead) // 57344
    assert (e.budget, e.weights, e.overhead) == (budget, weights, overhead)
    assert e.tokens == tokens == 1_013_912
    assert e.sequences == tokens // 10240 == 99


def test_orz_7b_fits_on_its_resources(capsys):
    cfg = recipe("orz_7b.yaml")
    plan = make_plan(cfg, Cluster(1, 8, 80))
    assert plan.fits and not plan.problems and not plan.warnings
    node = plan.nodes[0]
    assert node.trainer_gpus == (0, 1, 2, 3) and [s.gpus for s in node.engines] == [(4,), (5,), (6,), (7,)]
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml")
    assert code == 0
    assert "verdict: fits" in out and "engines 0-3" in out and "trainer ranks 1-3" in out
    assert "actor, reward pool (16 workers)" in out


def test_orz_7b_does_not_fit_on_24_gib_gpus(capsys):
    plan = make_plan(recipe("orz_7b.yaml"), Cluster(1, 8, 24))
    assert not plan.fits and plan.problems[0].startswith("trainer")
    assert any("resources.gpu_memory_gib=" in s.text and s.enough for s in plan.suggestions)
    assert any("trainer.micro_batch_tokens=" in s.text for s in plan.suggestions)
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--gpu-memory", "24")
    assert code == 1
    assert "does NOT fit" in out and "to make it fit" in out and "--gpu-memory" in out


def test_a_single_change_that_is_enough_is_named():
    plan = make_plan(recipe("orz_7b.yaml", "trainer.gradient_checkpointing=false"), Cluster(1, 8, 80))
    assert not plan.fits
    enough = [s for s in plan.suggestions if s.enough]
    assert {"trainer.gradient_checkpointing": True} in [s.changes for s in enough]


def test_json_output(capsys):
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    assert data["model"]["num_params"] == N_7B
    assert data["engine"]["kv_bytes_per_token"] == 57344 and data["engine"]["sequences"] == 99
    assert data["placement"][0]["trainer_gpus"] == [0, 1, 2, 3]


def test_a_local_model_directory_is_read_instead_of_the_table(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 10,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 50000, "tie_word_embeddings": True}))
    cfg = recipe("orz_7b.yaml", f"model.path={tmp_path}")
    shape = model_shape(cfg)
    h, kvd = 1024, 2 * 128
    layer = (h * h + h) + 2 * (h * kvd + kvd) + h * h + 3 * h * 4096 + 2 * h
    assert shape.source.endswith("config.json") and shape.head_dim == 128
    assert shape.num_params == 50000 * h + 10 * layer + h
    assert make_plan(cfg, Cluster(1, 8, 80)).engine.kv_bytes_per_token == 2 * 10 * 2 * 128 * 2
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", f"model.path={tmp_path}")
    assert code == 0 and str(tmp_path) in out


def test_an_unknown_model_name_is_a_config_error(capsys):
    with pytest.raises(ConfigError, match="local"):
        model_shape(recipe("orz_7b.yaml", "model.path=someone/Unknown-7B"))
    code, _, err = run_cli(capsys, "recipes/orz_7b.yaml", "model.path=someone/Unknown-7B")
    assert code == 2 and err.startswith("pipelinerl plan: config error: model.path")


def test_a_cpu_recipe_is_planned_without_gpus(capsys):
    code, out, _ = run_cli(capsys, "recipes/tiny_cpu.yaml")
    assert code == 0
    assert "CPU only" in out and "CPU  trainer" in out and "CPU  engine 0" in out
    assert "GiB needed" not in out and "host RAM" in out


@pytest.mark.parametrize("argv, flag", [
    (["--nodes", "0"], "--nodes"),
    (["--gpus-per-node", "-1"], "--gpus-per-node"),
    (["--gpu-memory", "0"], "--gpu-memory"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, flag):
    code, _, err = run_cli(capsys, "recipes/orz_7b.yaml", *argv)
    assert code == 2 and "config error" in err and flag in err


def test_a_flag_that_is_not_a_number_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "recipes/orz_7b.yaml", "--nodes", "two"])
    assert exit_.value.code == 2 and "--nodes" in capsys.readouterr().err


def test_flags_may_come_before_between_or_after_overrides(capsys):
    for argv in (["--gpu-memory", "24", "recipes/orz_7b.yaml", "trainer.max_steps=5"],
                 ["recipes/orz_7b.yaml", "--gpu-memory", "24", "trainer.max_steps=5"],
                 ["recipes/orz_7b.yaml", "trainer.max_steps=5", "--gpu-memory=24"]):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 1 and "8 GPUs of 24 GiB" in out


def test_multi_node_recipes_place_engines_on_every_node_and_need_a_reachable_host(capsys):
    plan = make_plan(recipe("orz_7b.yaml", "engine.host=0.0.0.0"), Cluster(2, 8, 80))
    assert [len(n.engines) for n in plan.nodes] == [4, 8]
    code, _, err = run_cli(capsys, "recipes/orz_7b.yaml", "--nodes", "2")
    assert code == 2 and "engine.host" in err


def test_sharding_is_read_from_the_accelerate_and_deepspeed_configs(tmp_path):
    fsdp = recipe("orz_7b.yaml", "trainer.accelerate_config=configs/accelerate/fsdp.yaml")
    assert detect_sharding(fsdp).kind == "fsdp"
    assert detect_sharding(recipe("orz_7b.yaml", "trainer.accelerate_config=''")).kind == "ddp"
    assert detect_sharding(recipe("orz_7b.yaml", "trainer.accelerate_config=''", "trainer.num_processes=1")).kind \
        == "none"
    ds = tmp_path / "offload.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    yaml = tmp_path / "offload.yaml"
    yaml.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {ds}\n")
    cfg = recipe("orz_7b.yaml", f"trainer.accelerate_config={yaml}", "preset=dapo")
    sharding = detect_sharding(cfg)
    assert (sharding.kind, sharding.offload_optimizer, sharding.offload_params) == ("zero3", True, False)
    main = trainer_memory(known_shape("Qwen/Qwen2.5-7B"), cfg, sharding)
    # the optimizer (12 B) and fp32 gradient partitions (4 B) live in host RAM; bf16 parameters stay on the GPU
    assert main.state_bytes == N_7B * 2 // 4
    assert main.host_bytes == N_7B * 12 // 4 + N_7B * 4 // 4


def test_orz_32b_fits_on_four_nodes_of_141_gib():
    path = REPO / "recipes" / "orz_32b.yaml"
    if not path.exists():
        pytest.skip("recipes/orz_32b.yaml not written yet")
    plan = make_plan(recipe("orz_32b.yaml"), Cluster(4, 8, 141))
    assert plan.fits, plan.problems
    assert plan.nodes[1].trainer_gpus == tuple(range(8)) and not plan.nodes[0].engines and not plan.nodes[1].engines
    assert sum(len(n.engines) for n in plan.nodes) == 8  # of 2 GPUs each
    # ranks are numbered across the trainer's two nodes
    assert [u.roles for u in plan.gpus if u.node == 1][0] == ("trainer rank 8",)


def test_orz_1gpu_fits_with_trainer_and_engine_on_one_gpu():
    path = REPO / "recipes" / "orz_1gpu.yaml"
    if not path.exists():
        pytest.skip("recipes/orz_1gpu.yaml not written yet")
    cfg = recipe("orz_1gpu.yaml")
    r = cfg.resources
    plan = make_plan(cfg, Cluster(r.nodes, r.gpus_per_node, r.gpu_memory_gib))
    assert plan.fits, plan.problems
    (use,) = plan.gpus
    assert use.roles == ("trainer rank 0", "engine 0")
    assert use.need == plan.trainer_main.total + int(cfg.engine.gpu_memory_utilization * r.gpu_memory_gib * GIB)


def test_the_table_shows_one_decimal_gib():
    cfg = recipe("orz_7b.yaml", "preset=dapo")
    text = format_plan(make_plan(cfg, Cluster(1, 8, 80)), cfg, "recipes/orz_7b.yaml")
    assert "40.8" in text and "54.1" in text and "99 sequences of 10240" in text


def test_tensor_parallel_engines_hold_a_shard_of_the_weights_and_of_each_tokens_kv_per_gpu():
    shape = known_shape("Qwen/Qwen2.5-7B")
    one, two = (engine_memory(shape, recipe("orz_7b.yaml", f"engine.tensor_parallel_size={tp}"), 80 * GIB)
                for tp in (1, 2))
    assert one.weights == N_7B * 2 and two.weights == N_7B  # bf16, split over two GPUs
    assert one.kv_bytes_per_token == 2 * L * KV * HD * 2 and two.kv_bytes_per_token == 2 * L * (KV // 2) * HD * 2
    assert two.budget == one.budget  # each GPU gives the engine the same share
    assert two.sequences > 2 * one.sequences  # one copy of the weights between two GPUs: more KV room on each
    # fewer KV heads (4) than workers (8): each worker keeps a copy of one head
    eight = engine_memory(shape, recipe("orz_7b.yaml", "engine.tensor_parallel_size=8"), 80 * GIB)
    assert eight.kv_bytes_per_token == 2 * L * 1 * HD * 2
    cfg = recipe("orz_7b.yaml", "engine.tensor_parallel_size=2")
    plan = make_plan(cfg, Cluster(1, 8, 80))
    assert [s.gpus for s in plan.nodes[0].engines] == [(4, 5), (6, 7)]
    assert [u.roles for u in plan.gpus[4:]] == [("engine 0",), ("engine 0",), ("engine 1",), ("engine 1",)]
    assert all(u.need == two.budget for u in plan.gpus[4:])
    text = format_plan(plan, cfg, "recipes/orz_7b.yaml")
    assert "2 x vllm, tensor parallel 2" in text and "GiB per engine GPU (2 per engine)" in text


def test_an_engine_too_large_for_one_gpu_is_told_the_tensor_parallel_size_that_fits():
    cfg = recipe("orz_32b.yaml", "engine.tensor_parallel_size=1", "trainer.num_nodes=1", "trainer.num_processes=8")
    plan = make_plan(cfg, Cluster(4, 8, 48))  # 61 GiB of bf16 weights on a 48 GiB GPU
    assert plan.engine is not None and plan.engine.sequences == 0 and not plan.fits
    tp = [s for s in plan.suggestions if "engine.tensor_parallel_size" in s.changes]
    assert tp and tp[0].changes == {"engine.tensor_parallel_size": 2} and "12 engines of 2 GPUs" in tp[0].text


def test_vllm_update_staging_goes_to_the_gpu_only_where_the_budget_leaves_room():
    """vLLM stages a whole update on each worker beside its budget: 7B in bf16 with 0.9 of 80 GiB leaves 8 GiB, too
    little for 15 GB, so it is staged in host memory; at 0.75 it fits on the GPU."""
    shape = known_shape("Qwen/Qwen2.5-7B")
    tight = engine_memory(shape, recipe("orz_7b.yaml"), 80 * GIB)
    roomy = engine_memory(shape, recipe("orz_7b.yaml", "engine.gpu_memory_utilization=0.75"), 80 * GIB)
    assert tight.staging == roomy.staging > shape.num_params * 2
    assert not tight.staging_on_gpu and roomy.staging_on_gpu
    # what does not fit on the GPU is streamed into the weights, not staged in host memory
    assert tight.streamed and tight.host_staging == 0 and not roomy.streamed
    assert engine_memory(shape, recipe("orz_7b.yaml", "engine.kind=embedded"), 80 * GIB).staging == 0


def test_host_memory_per_node_is_checked_against_the_nodes_memory(capsys, monkeypatch):
    """At 32B with tensor parallel 2, staging every update in host memory would take the whole update on each of an
    engine node's 8 workers (8 x 65 GiB); streamed (the default where it does not fit on the GPU) it takes none."""
    code, out, _ = run_cli(capsys, "recipes/orz_32b.yaml", "--host-memory", "512")
    assert code == 0 and "host memory per node: node 0 48.0 GiB, node 1 48.0 GiB, node 2 48.0 GiB" in out
    monkeypatch.setenv("PIPELINERL_VLLM_STAGING", "cpu")
    code, out, _ = run_cli(capsys, "recipes/orz_32b.yaml", "--host-memory", "512")
    assert code == 1 and "node 2 567.4 GiB" in out
    assert "host: nodes 2-3 need up to 567.4 GiB of host memory, and a node has 512.0 GiB" in out
    assert "PIPELINERL_VLLM_STAGING=cpu; leave it unset to stream them instead" in out
    code, _, err = run_cli(capsys, "recipes/orz_32b.yaml", "--host-memory", "-1")
    assert code == 2 and "--host-memory" in err


def test_the_plan_gives_the_checkpoints_disk_and_the_engines_start_deadline(capsys):
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--host-memory", "0")
    assert code == 0 and "checkpoint: 213.2 GB (policy 106.6 GB, critic 106.6 GB; 14 B per parameter" in out
    assert "up to 3 at once in run_dir" in out and "engines must answer within 900 s" in out
    code, out, _ = run_cli(capsys, "recipes/orz_32b.yaml", "--host-memory", "0")
    assert "checkpoint: 917.4 GB" in out and "2.75 TB" in out and "engines must answer within 1080 s" in out
    code, out, _ = run_cli(capsys, "recipes/orz_32b.yaml", "--host-memory", "0", "engine.start_timeout_s=3000",
                           "--json")
    assert json.loads(out)["engine_start_timeout_s"] == 3000


def test_the_launcher_refuses_a_run_dir_that_cannot_hold_two_checkpoints(monkeypatch, tmp_path):
    import shutil

    from pipelinerl.launch import run_dir_disk

    cfg = recipe("orz_7b.yaml", f"run_dir={tmp_path / 'run'}")
    free = {"bytes": 300 * 10**9}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**13, 0, free["bytes"]))
    problem, warning = run_dir_disk(cfg)
    assert warning is None and problem.startswith(f"run_dir: {tmp_path} has 300.0 GB free, and two checkpoints")
    free["bytes"] = 500 * 10**9  # two fit, three (keep_checkpoints 2 and the one being written) do not
    problem, warning = run_dir_disk(cfg)
    assert problem is None and "less than the 639.7 GB of the 3 checkpoints the run holds at once" in warning
    free["bytes"] = 700 * 10**9
    assert run_dir_disk(cfg) == (None, None)
    assert run_dir_disk(recipe("tiny_cpu.yaml")) == (None, None)  # a tiny model: megabytes, not checked
