"""Setting up a GPU node, as `make` runs it: flash-attention from a prebuilt wheel, and a check that a venv can run
a GPU recipe before a job is given to SLURM or an engine is started.

    python -m pipelinerl.gpu_setup flash-attn --uv "UV INSTALL COMMAND"
        flash-attn from the wheel of its GitHub release that matches this venv's torch, CUDA, C++ ABI and Python,
        installed with the given command (the Makefile's uv, constrained to the installed torch). It is never
        compiled: without nvcc that fails, and with it, it takes hours of a node (or its memory: nvcc at
        default MAX_JOBS). Where no such wheel exists it prints one line and exits 0: the trainer then uses sdpa.
    python -m pipelinerl.gpu_setup check RECIPE [overrides] [--on-node]
        exit 0 when the venv has torch's CUDA build and the GPU build of the recipe's engine.kind installed (and,
        with --on-node, torch sees the recipe's resources.gpus_per_node GPUs here); otherwise one line per
        problem, each naming the command that fixes it, and exit 2. A venv built on a machine without GPUs (a
        login node, with plain `make install`) has torch's CPU build: refused here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.contracts.engine import engine_kind

FLASH_ATTN_VERSION = "2.8.3"  # the newest release with prebuilt wheels on GitHub (PyPI has its source only)
FLASH_ATTN_URL = "https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/{wheel}"
FLASH_ATTN_URL_ENV = "PIPELINERL_FLASH_ATTN_URL"  # a mirror: the same layout, {version} and {wheel} filled in
DOWNLOAD_TIMEOUT_S = 600.0
FROM_SOURCE = "MAX_JOBS=8 .venv/bin/pip install flash-attn --no-build-isolation (nvcc needed; 1-2 h)"
REBUILD = "make clean && make install (on a node with GPUs), or make install GPU=1 where there are none"


@dataclass(frozen=True)
class TorchBuild:
    version: str  # the distribution's version, as an installer sees it ("2.13.0", "2.13.0+cpu")
    cuda: str | None  # the CUDA it was built with ("13.0"); None for a CPU build
    cxx11_abi: bool

    @classmethod
    def installed(cls) -> TorchBuild:
        import torch

        return cls(importlib.metadata.version("torch"), torch.version.cuda, bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def flash_attn_wheel(build: TorchBuild, python: str | None = None, machine: str | None = None,
                     version: str = FLASH_ATTN_VERSION) -> str:
    """The file name flash-attn's release gives the wheel for this torch (named as flash-attn's own setup.py
    guesses it: CUDA major version, torch major.minor, the C++ ABI, the Python tag, the platform)."""
    if build.cuda is None:
        raise ValueError(f"torch {build.version} is a CPU build: flash-attn needs CUDA")
    torch_mm = ".".join(build.version.split("+")[0].split(".")[:2])
    cuda_major = build.cuda.split(".")[0]
    py = python or python_tag()
    plat = f"linux_{machine or platform.machine()}"
    abi = str(build.cxx11_abi).upper()
    return f"flash_attn-{version}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{py}-{py}-{plat}.whl"


def flash_attn_url(wheel: str, version: str = FLASH_ATTN_VERSION) -> str:
    return os.environ.get(FLASH_ATTN_URL_ENV, FLASH_ATTN_URL).format(version=version, wheel=wheel)


def install_flash_attn(uv_install: str, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> int:
    """Download the matching wheel and install it; one line and 0 where there is none (or it cannot be had)."""
    try:
        import flash_attn  # noqa: F401

        print(f"flash-attn {importlib.metadata.version('flash-attn')} is installed")
        return 0
    except ImportError:
        pass
    build = TorchBuild.installed()
    try:
        wheel = flash_attn_wheel(build)
    except ValueError as e:
        print(f"flash-attn skipped: {e}; the trainer uses sdpa")
        return 0
    url = flash_attn_url(wheel)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / wheel
        try:
            with urllib.request.urlopen(url, timeout=60) as resp, open(path, "wb") as out:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else str(getattr(e, "reason", e))
            print(f"flash-attn skipped: no prebuilt wheel {wheel} for torch {build.version} (CUDA {build.cuda}) "
                  f"could be had from {url} ({reason}); the trainer uses sdpa. To build it instead: {FROM_SOURCE}")
            return 0
        try:
            subprocess.run([*shlex.split(uv_install), str(path)], check=True, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"flash-attn skipped: installing {wheel} failed ({e}); the trainer uses sdpa")
            return 0
    print(f"flash-attn installed from {wheel}")
    return 0


def engine_problem(engine: str, gpu: bool) -> str | None:
    """Why the venv cannot run `engine` on a machine with (`gpu`) or without GPUs, with the command that fixes it;
    None when it can. Read from the installed distributions' metadata (no import: fast, and right on a login node
    whose CUDA packages cannot initialise without a GPU)."""
    problem = engine_kind(engine).install_problem
    return None if problem is None else problem(gpu)


def venv_problems(engine: str, gpus: int | None = None) -> list[str]:
    """What keeps this venv from running a GPU recipe with `engine` (see the module docstring)."""
    problems = []
    try:
        build = TorchBuild.installed()
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return [f"torch is not installed in {sys.prefix}: make install"]
    if build.cuda is None:
        problems.append(f"torch {build.version} in {sys.prefix} is a CPU build (this venv was made on a machine "
                        f"without GPUs), so no process of the run could use a GPU; rebuild it: {REBUILD}")
    else:
        problem = engine_problem(engine, gpu=True)
        if problem:
            problems.append(problem)
    if gpus and build.cuda is not None:
        import torch

        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if seen < gpus:
            problems.append(f"torch sees {seen} GPU(s) on this node and the recipe needs {gpus} "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; "
                            "nvidia-smi says what the node has)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelinerl.gpu_setup", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fa = sub.add_parser("flash-attn", help="install flash-attn from its prebuilt wheel, or skip saying why")
    fa.add_argument("--uv", required=True, help="the install command, given the wheel's path as its last argument")
    ck = sub.add_parser("check", help="can this venv run a GPU recipe?",
                        usage="python -m pipelinerl.gpu_setup check [RECIPE [overrides...]] [--on-node]")
    # RECIPE, its dotted overrides, and the flags, in any order (a batch script passes the run's own arguments,
    # `--dry-run` among them, which is ignored here)
    ck.add_argument("args", nargs=argparse.REMAINDER, help="RECIPE [overrides...] [--on-node]: with --on-node the "
                    "recipe's resources.gpus_per_node GPUs must also be seen here (inside a job)")
    args = parser.parse_args(argv)
    if args.command == "flash-attn":
        return install_flash_attn(args.uv)
    flags = {a for a in args.args if a.startswith("--")}
    unknown = flags - {"--on-node", "--dry-run"}
    if unknown:
        parser.error(f"check: unknown option {sorted(unknown)[0]}")
    positional = [a for a in args.args if not a.startswith("--")]
    engine, gpus = "vllm", None
    if positional:
        from pipelinerl.config import ConfigError, load_config

        try:
            cfg = load_config(positional[0], positional[1:])
        except ConfigError as e:
            print(f"pipelinerl: config error: {e}", file=sys.stderr)
            return 2
        engine = cfg.engine.kind
        gpus = cfg.resources.gpus_per_node if "--on-node" in flags else None
    problems = venv_problems(engine, gpus)
    for problem in problems:
        print(f"pipelinerl: {problem}", file=sys.stderr)
    if not problems:
        build = TorchBuild.installed()
        print(f"{sys.prefix}: torch {build.version} (CUDA {build.cuda}), engine {engine}: ready for GPUs")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
