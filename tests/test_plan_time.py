"""`pipelinerl plan RECIPE --time`: the forecast of one RL step and of the run. Checked by what must move with
what (answer length, engines, bandwidth, max_lag), against one figure worked out by hand from the H100's datasheet,
and through the command line."""

import json
from pathlib import Path

import pytest

from pipelinerl import cli
from pipelinerl.config import ConfigError, load_config, resolve_for_machine
from pipelinerl.plan import (
    ACCELERATORS,
    Cluster,
    accelerator,
    assumptions,
    default_gpu,
    forecast,
    make_plan,
    probe_cpu,
)

REPO = Path(__file__).resolve().parents[1]
N_7B = 7_615_616_512  # Qwen2.5-7B (tests/test_plan.py works it out from the published config)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def forecast_of(name: str, *overrides: str, gpu: str = "h100", **given):
    cfg = load_config(REPO / "recipes" / name, list(overrides))
    r = cfg.resources
    cluster = Cluster(r.nodes, r.gpus_per_node, r.gpu_memory_gib)
    cfg, _ = resolve_for_machine(cfg, cluster.gpus_per_node)
    acc = accelerator(gpu)
    return forecast(cfg, make_plan(cfg, cluster), acc, assumptions(cfg, acc, **given))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_decode_step_by_hand_from_the_h100_datasheet():
    # 512 sequences (engine.max_running_seqs: the KV cache would hold 807 at 256 + 1000 tokens each), each with
    # 1256 tokens of 57,344 B of KV cache on average, and the bf16 weights, read at 0.7 of 3.35 TB/s
    f = forecast_of("orz_7b.yaml", mean_answer_tokens=2000)
    assert f.running_per_engine == 512 and f.running_bound == "engine.max_running_seqs"
    read = 2 * N_7B + 512 * (256 + 1000) * 57344
    assert f.decode_memory_bound  # 512 x 2N FLOPs at 0.4 of 989 TFLOPS take 18.9 ms, the bytes 22.2
    assert f.decode_step_s == pytest.approx(read / (0.7 * 3.35e12))
    # 8192 samples over 4 engines, 2000 tokens each, 512 at a time
    assert f.decode_s == pytest.approx(2048 * 2000 / 512 * f.decode_step_s)
    # shorter answers, less KV to read: at 512 sequences the FLOPs take longer than the bytes
    assert not forecast_of("orz_7b.yaml", mean_answer_tokens=500).decode_memory_bound


def test_doubling_max_new_tokens_about_doubles_the_decode_time():
    short = forecast_of("orz_7b.yaml", "sampling.max_new_tokens=2000")
    long = forecast_of("orz_7b.yaml", "sampling.max_new_tokens=4000")
    assert long.assumptions.mean_answer_tokens == 2 * short.assumptions.mean_answer_tokens == 2000
    # twice the decode steps, each reading a little more KV cache
    assert 2.0 < long.decode_s / short.decode_s < 2.6
    assert long.train_s / short.train_s == pytest.approx((256 + 2000) / (256 + 1000), rel=0.05)


def test_synchronous_steps_add_up_and_pipelined_ones_overlap():
    sync = forecast_of("orz_7b.yaml", "actor.max_lag=0", mean_answer_tokens=1000)
    assert not sync.pipelined
    assert sync.step_s == pytest.approx(sync.generate_s + sync.train_s + sync.broadcast_s)
    piped = forecast_of("orz_7b.yaml", "actor.max_lag=1", mean_answer_tokens=1000)
    assert piped.pipelined
    assert piped.step_s == pytest.approx(max(piped.generate_s, piped.train_s) + piped.broadcast_s)
    assert piped.step_s < sync.step_s
    assert piped.samples_per_s > sync.samples_per_s


def test_a_synchronous_step_waits_for_its_longest_answer():
    # short answers on average, but one of max_new_tokens decoded alone takes longer than the whole batch's share
    f = forecast_of("orz_7b.yaml", "actor.max_lag=0", mean_answer_tokens=50)
    assert f.generate_s == pytest.approx(f.longest_answer_s) and f.longest_answer_s > f.prefill_s + f.decode_s
    assert any("longest answer" in n for n in f.notes)


def test_more_engines_generate_faster():
    two = forecast_of("orz_7b.yaml", "engine.num_engines=2", mean_answer_tokens=2000)
    four = forecast_of("orz_7b.yaml", mean_answer_tokens=2000)
    assert (two.engines, four.engines) == (2, 4)
    assert four.generate_s < two.generate_s
    assert two.generate_s / four.generate_s == pytest.approx(2, rel=0.1)
    assert two.train_s == pytest.approx(four.train_s)  # the same 4 trainer GPUs


def test_h200_decodes_faster_than_h100_by_its_bandwidth():
    h100 = forecast_of("orz_7b.yaml", gpu="h100", mean_answer_tokens=4000)
    h200 = forecast_of("orz_7b.yaml", gpu="h200", mean_answer_tokens=4000)
    assert h100.decode_memory_bound and h200.decode_memory_bound
    assert h100.decode_step_s / h200.decode_step_s == pytest.approx(4.8 / 3.35)
    assert h200.train_s == pytest.approx(h100.train_s)  # the same compute
    a100 = forecast_of("orz_7b.yaml", gpu="a100", mean_answer_tokens=4000)
    assert a100.train_s / h100.train_s == pytest.approx(989 / 312)


def test_the_critic_and_the_kl_reference_add_their_passes():
    ppo = forecast_of("orz_7b.yaml", mean_answer_tokens=1000)
    assert [what for what, _, _ in ppo.train_parts] == ["policy training", "critic values", "critic training"]
    grpo = forecast_of("orz_7b.yaml", "preset=dapo", mean_answer_tokens=1000)
    assert [what for what, _, _ in grpo.train_parts] == ["policy training"]
    assert 2.0 < ppo.train_s / grpo.train_s < 2.5  # the critic: a forward and a checkpointed training pass more
    kl = forecast_of("orz_7b.yaml", "preset=dapo", "trainer.kl_coef=0.01", mean_answer_tokens=1000)
    assert kl.train_s / grpo.train_s == pytest.approx(5 / 4)  # a forward more on top of 4 (checkpointed)


def test_weights_cross_infiniband_to_engines_on_other_nodes():
    f = forecast_of("orz_32b.yaml", gpu="h200", mean_answer_tokens=2000)
    assert f.engines == 8 and f.devices_per_engine == 2 and f.devices == 32
    assert "InfiniBand" in f.link and f.gather_s > 0  # ZeRO-3 over the two trainer nodes gathers first
    assert f.update_bytes == pytest.approx(2 * 32_763_876_352)
    one_node = forecast_of("orz_7b.yaml", mean_answer_tokens=2000)
    assert "NVLink" in one_node.link


def test_the_run_and_its_cost():
    f = forecast_of("orz_7b.yaml", mean_answer_tokens=1000, usd_per_device_hour=2.5)
    assert f.run_s == pytest.approx(1000 * f.step_s)
    assert f.device_hours == pytest.approx(f.run_s / 3600 * 8)  # the node's 8 GPUs are held, busy or not
    assert f.cost_usd == pytest.approx(2.5 * f.device_hours)


def test_the_default_accelerator_follows_the_recipes_gpus():
    assert default_gpu(load_config(REPO / "recipes/orz_7b.yaml", [])) == "h100"
    assert default_gpu(load_config(REPO / "recipes/orz_32b.yaml", [])) == "h200"  # 141 GiB GPUs
    assert default_gpu(load_config(REPO / "recipes/tiny_cpu.yaml", [])) == "cpu"
    assert ACCELERATORS["h200"].memory_gb == 141


def test_the_probe_measures_positive_figures():
    acc = probe_cpu(0.2)
    assert acc.flops > 0 and acc.memory_bytes_per_s > 0 and acc.unit == "core"


def test_the_cli_prints_the_forecast_for_orz_7b(capsys):
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--time", "--host-memory", "0")
    assert code == 0
    assert "verdict: fits" in out and "forecast (--time): H100 SXM" in out
    assert "assumed: answers of 4,000 tokens" in out and "Assumptions, not measurements" in out
    for row in ("generate", "decode", "train", "broadcast", "step", "samples/s", "GPU-hours"):
        assert row in out
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--gpu", "h200", "--usd-per-gpu-hour", "3")
    assert code == 0 and "H200 SXM" in out and "$3 per GPU-hour" in out  # a forecast flag asks for the forecast


def test_the_json_carries_the_forecast(capsys):
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--json", "--time", "--mean-answer-tokens", "1000")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    fc = data["forecast"]
    assert fc["assumptions"]["mean_answer_tokens"] == 1000 and fc["engines"] == 4
    assert fc["step_s"] == pytest.approx(max(fc["generate_s"], fc["train_s"]) + fc["broadcast_s"])
    code, out, _ = run_cli(capsys, "recipes/orz_7b.yaml", "--json")
    assert "forecast" not in json.loads(out)


def test_a_cpu_recipe_is_forecast_from_the_probe(capsys):
    code, out, _ = run_cli(capsys, "recipes/tiny_cpu.yaml", "--time")
    assert code == 0 and "CPU core (measured here)" in out and "core-hours" in out


@pytest.mark.parametrize("argv, flag", [
    (["--gpu", "tpu"], "--gpu"),
    (["--gpu", "cpu"], "--gpu"),  # a GPU recipe
    (["--time", "--mfu", "0"], "--mfu"),
    (["--time", "--mbu", "1.5"], "--mbu"),
    (["--time", "--mean-answer-tokens", "0"], "--mean-answer-tokens"),
    (["--time", "--mean-answer-tokens", "9000"], "--mean-answer-tokens"),  # beyond sampling.max_new_tokens
    (["--time", "--mean-prompt-tokens", "5000"], "--mean-prompt-tokens"),
    (["--time", "--usd-per-gpu-hour", "-1"], "--usd-per-gpu-hour"),
])
def test_bad_forecast_flags_exit_2_naming_the_flag(capsys, argv, flag):
    code, _, err = run_cli(capsys, "recipes/orz_7b.yaml", *argv)
    assert code == 2 and "config error" in err and flag in err


def test_a_gpu_kind_for_a_cpu_recipe_is_refused(capsys):
    code, _, err = run_cli(capsys, "recipes/tiny_cpu.yaml", "--gpu", "h100")
    assert code == 2 and "--gpu" in err and "CPU recipe" in err
    with pytest.raises(ConfigError, match="--gpu"):
        accelerator("v100")
