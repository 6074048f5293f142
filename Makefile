# Quick start: `make run` (the tiny CPU recipe end to end) and `make test`.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Which build the venv gets. GPU=auto (the default): the GPU build (PyPI's CUDA torch, the `gpu` extra, vLLM's GPU
# wheel) where nvidia-smi lists a GPU, the CPU build elsewhere. GPU=1: the GPU build on a machine without GPUs, such
# as a SLURM login node preparing the venv that its compute nodes run (`make run-32b` does this). GPU=0: the CPU build.
GPU ?= auto
ifeq ($(GPU),auto)
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo 1)
else ifeq ($(GPU),1)
HAS_GPU := 1
else ifeq ($(GPU),0)
HAS_GPU :=
else
$(error GPU=$(GPU): must be auto, 1 (the GPU build) or 0 (the CPU build))
endif
BUILD := $(if $(HAS_GPU),gpu,cpu)
EXTRAS ?= dev$(if $(HAS_GPU),$(comma)gpu)
comma := ,
# one stamp per build: a venv made on a machine of the other kind is rebuilt for this one, not taken as it is
STAMP := $(VENV)/.installed-$(BUILD)
PYTEST_ARGS ?=
# test files run on this many pytest-xdist workers, a file's tests on one worker (its module fixtures once), in the
# order tests/conftest.py gives them
TEST_WORKERS ?= 2

.PHONY: install pins fuzz chaos run compare compare-algorithms compare-presets compare-critic compare-domains compare-long step-cost rehearsal-seeds compare-tools compare-trl test test-quick test-gpu bench lint format openapi config-reference clean data-orz run-orz-cpu run-1gpu run-7b run-32b

install: $(STAMP)

# torch goes in with pip, which alone looks where a machine keeps its own torch wheel; everything after it with uv
# (put in the venv by pip), which resolves and installs in seconds what takes pip a minute and compiles the bytecode
# on every core, against TORCH_PIN (the torch just installed), so that nothing it installs can replace that torch.
TORCH_PIN := $(VENV)/torch-pin.txt
UV_INSTALL = $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode --constraint $(TORCH_PIN)
ENSURE_UV = test -x $(BIN)/uv || $(BIN)/python -m pip install --no-compile "uv>=0.5"
# `name==version` of installed distributions, as an installer sees them: from their metadata, never from the
# package's __version__. PyPI's CUDA torch is 2.13.0 to pip and uv while torch.__version__ says 2.13.0+cu130, a
# version no index lists (pytorch/pytorch#103246): a pin written from __version__ cannot be resolved.
PINS = $(BIN)/python -c "import importlib.metadata as m, sys; print('\n'.join(f'{d}=={m.version(d)}' for d in sys.argv[1:]))"
PIN_TORCH = $(PINS) torch > $(TORCH_PIN)
# exit 0 when the venv's torch is of this build (a CUDA build for gpu, a +cpu one for cpu)
TORCH_IS_BUILD = $(BIN)/python -c "import importlib.metadata as m, sys; sys.exit(('+cpu' in m.version('torch')) != ('$(BUILD)' == 'cpu'))"

# `make install-vllm`; `make test` also installs vLLM (CPU build here) so its tests run for real.
include configs/vllm_install.mk

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed $(VENV)/.installed-cpu $(VENV)/.installed-gpu
	# a torch of the other build goes first: pip counts 2.13.0+cpu as torch==2.13.0 and would keep it
	$(TORCH_IS_BUILD) 2>/dev/null || $(BIN)/python -m pip uninstall -y -q torch 2>/dev/null || true
ifeq ($(HAS_GPU),1)
	$(BIN)/python -m pip install --no-compile "torch==$(TORCH_VERSION)"
	@$(BIN)/python -c "import torch, sys; sys.exit(torch.version.cuda is None)" || { echo "make install: pip \
	  installed a CPU build of torch ($$($(PINS) torch)) where the GPU build was asked for; this machine has a local \
	  CPU wheel: uninstall it (.venv/bin/pip uninstall torch) and install from PyPI"; exit 1; }
else
	# The CPU build: a local wheel where the machine has one, else PyTorch's CPU index; never a CUDA build.
	$(BIN)/python -m pip install --no-compile "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(BIN)/python -m pip install --no-compile "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
endif
	# the bytecode of torch and what came with it, on every core (pip compiles file by file)
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
	$(PIN_TORCH)
	$(ENSURE_UV)
	$(UV_INSTALL) -e ".[$(EXTRAS)]"
ifeq ($(HAS_GPU),1)
	# flash-attention 2 (packed micro-batches without a dense mask) from the prebuilt wheel that matches this torch,
	# CUDA, C++ ABI and Python, where its release has one; never compiled here (hours of nvcc). Without it the
	# trainer uses sdpa, saying so (trainer.attn_implementation).
	$(BIN)/python -m pipelinerl.gpu_setup flash-attn --uv "$(UV_INSTALL)"
endif
	touch $(STAMP)

# the constraint files later installs are held to, written from the venv as it is (the install targets write them
# the same way as they go; this rewrites them, e.g. after installing a torch by hand)
pins:
	$(PIN_TORCH)
	$(PINS) torch transformers > $(VLLM_CONSTRAINTS)

run: $(STAMP)
	$(BIN)/pipelinerl run recipes/tiny_cpu.yaml $(ARGS)

# --- Open-Reasoner-Zero -----------------------------------------------------------------------------------------
# ORZ's public data (training sets and eval sets, each checked against a pinned checksum) into data/orz/.
data-orz: $(STAMP)
	$(BIN)/pipelinerl data orz

# The CPU rehearsal of the ORZ path: synthetic word problems in ORZ's formats, a tiny model, 2 cores.
run-orz-cpu: $(STAMP)
	$(BIN)/python -m pipelinerl.tasks.synthetic_math data/orz_synthetic
	$(BIN)/pipelinerl run recipes/orz_cpu.yaml $(ARGS)

# what the ORZ recipes' data needs first (RUN_DATA= where ARGS points task.train_data/eval_data at data of your own)
RUN_DATA ?= data-orz

# Qwen2.5-7B on one node of 8 GPUs. Checked before the install, so a machine without them stops in seconds; then
# the GPU build with vLLM's GPU wheel, ORZ's data, and the run (whose launcher fetches the model once, before any
# engine starts, into the Hugging Face cache: HF_HOME).
run-7b:
	@n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); if [ "$$n" -lt 8 ]; then \
	  echo "make run-7b: recipes/orz_7b.yaml needs one node with 8 GPUs of 80 GB (4 train with DeepSpeed ZeRO-3, 4 run"; \
	  echo "vLLM engines); this machine has $$n. 'make install && .venv/bin/pipelinerl plan recipes/orz_7b.yaml' prints"; \
	  echo "where every process goes and the memory each GPU needs, on any machine."; exit 2; fi
	$(MAKE) --no-print-directory install install-vllm $(RUN_DATA)
	$(BIN)/pipelinerl run recipes/orz_7b.yaml $(ARGS)

# Qwen2.5-0.5B on one GPU of 48 GB or more, trainer and a vLLM engine sharing it (ORZ's one-GPU setting).
run-1gpu:
	@n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); if [ "$$n" -lt 1 ]; then \
	  echo "make run-1gpu: recipes/orz_1gpu.yaml needs a GPU of 48 GB or more; this machine has none."; \
	  echo "'make install && .venv/bin/pipelinerl plan recipes/orz_1gpu.yaml' prints the memory it needs."; exit 2; fi
	$(MAKE) --no-print-directory install install-vllm $(RUN_DATA)
	$(BIN)/pipelinerl run recipes/orz_1gpu.yaml $(ARGS)

# Qwen2.5-32B on 4 nodes of 8 GPUs, submitted to SLURM. The venv is built here with the GPU build (GPU=1: CUDA torch
# and vLLM's GPU wheel install on a login node without GPUs) on the filesystem the nodes share, with the data; the
# job checks on its first node that torch sees the GPUs before any node starts (configs/slurm/pipelinerl.sbatch).
# Without SLURM, the command for every node.
SBATCH_ARGS ?=
run-32b:
	@if ! command -v sbatch >/dev/null; then \
	  echo "make run-32b: recipes/orz_32b.yaml needs 4 nodes with 8 GPUs of 141 GB each (H200 class; see"; \
	  echo "'pipelinerl plan recipes/orz_32b.yaml'). No SLURM here (no sbatch). After 'make install install-vllm data-orz'"; \
	  echo "on a node with GPUs, on a filesystem all nodes share, run on node i = 0..3 (node 0's address in MASTER_ADDR):"; \
	  echo "  WORLD_SIZE=4 RANK=i MASTER_ADDR=<node 0> MASTER_PORT=29500 .venv/bin/pipelinerl run recipes/orz_32b.yaml \\"; \
	  echo "      engine.host=0.0.0.0 $(ARGS)"; \
	  exit 2; \
	fi
	$(MAKE) --no-print-directory install install-vllm $(RUN_DATA) GPU=1
	$(BIN)/python -m pipelinerl.gpu_setup check recipes/orz_32b.yaml $(ARGS)
	@mkdir -p logs
	@job=$$(PIPELINERL_VENV=$(abspath $(VENV)) sbatch --parsable --nodes 4 --gpus-per-node 8 $(SBATCH_ARGS) \
	  configs/slurm/pipelinerl.sbatch recipes/orz_32b.yaml $(ARGS)) || exit 1; job=$${job%%;*}; \
	  echo "submitted SLURM job $$job: its log is logs/pipelinerl-$$job.out (tail -f it; squeue -j $$job; scancel $$job)"

# The tiny recipe twice, pipelined (max_lag 2) and synchronous (max_lag 0): one PNG of both curves against
# wall-clock time and samples, in bench/results/tiny_sync_vs_pipelined.png.
compare: $(STAMP)
	$(BIN)/python -m bench.pipeline_vs_sync --compare

# synchronous vs one-step off-policy vs pipelined RL on long-tailed answers (recipes/counting_long_cpu.yaml), to the
# same held-out accuracy, several seeds (bench/compare_long.py). ARGS="--seeds 0 --steps 30" for a shorter race
compare-long: $(STAMP)
	$(BIN)/python -m bench.compare_long $(ARGS)

# every RL algorithm on the tiny recipe, side by side (docs/algorithms.md)
compare-algorithms: $(STAMP)
	$(BIN)/python -m bench.algorithms

# the papers' presets (recipes/presets/) on the tiny recipe at its scale, 3 seeds each (docs/algorithms.md)
compare-presets: $(STAMP)
	$(BIN)/python -m bench.algorithms --presets $(ARGS)

# why PPO with a critic collapsed in the ORZ rehearsal: ten arms x 6 seeds of recipes/orz_cpu.yaml, 50 steps each,
# two runs side by side (docs/algorithms.md; about 1.5 min a run on 2 cores). ARGS="--only A,I --seeds 3"
compare-critic: $(STAMP)
	$(BIN)/python -m bench.orz_critic $(ARGS)

# where a step's time goes when compute costs next to nothing (tiny_cpu with a hidden-16 one-layer model, pipelined
# and synchronous, 200 steps each; about 2 minutes): the pipeline's fixed cost per step, stage by stage
step-cost: $(STAMP)
	$(BIN)/python -m bench.step_cost $(ARGS)

# make test's ORZ rehearsal (tests/test_orz_rehearsal.py: PPO with the critic) on several seeds, two at a time, each
# held to the same checks; SEEDS=0,1 for fewer (about 6 minutes a pair on 2 cores)
rehearsal-seeds: $(STAMP)
	PIPELINERL_REHEARSAL_SEEDS=$(or $(SEEDS),0,1,2,3,4,5) $(BIN)/python -m pytest -q -s -n 2 \
	  tests/test_orz_rehearsal.py

# the code recipes: tiny_code_cpu's learning curve, and the interpreter as a tool against single-turn (docs/code.md)
# what mixing domains costs or gains: recipes/tiny_mix_cpu.yaml on its three domains, then each domain alone from the
# mix's base model for the same steps (bench/compare_domains.py). ARGS="--seeds 0,1,2 --steps 200"
compare-domains: $(STAMP)
	$(BIN)/python -m bench.compare_domains $(ARGS)

compare-tools: $(STAMP)
	$(BIN)/python -m bench.code_tasks

# pipelinerl against TRL's GRPOTrainer (issue 21): wall-clock time to the same held-out accuracy, each side's lr
# tuned over a grid; recipes/tiny_cpu.yaml (~30 min), then recipes/counting_cpu.yaml (hours). Installs the `bench`
# extra (TRL) on first use. bench/results/vs_trl_<recipe>.{json,png}; ARGS="--recipe recipes/tiny_cpu.yaml" for one.
compare-trl: $(STAMP)
	$(BIN)/python -c "import trl" 2>/dev/null || { $(ENSURE_UV) && $(PIN_TORCH) && $(UV_INSTALL) -e ".[bench]"; }
	$(BIN)/python -m bench.vs_trl $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The GPU checks in one command (tests/gpu): NCCL updates into the embedded engine and vLLM while they generate,
# the tiny recipe on GPUs, a 2-GPU ZeRO-3 trainer pushing to an engine, the vLLM pause benchmark. Installs as
# `make test` does (CUDA torch, the gpu extra and vLLM's GPU build on a GPU machine); each check skips, saying
# why, where the GPUs it needs are missing. (`make test` collects them too: without a GPU they skip at once.)
test-gpu: install-vllm-optional
	$(BIN)/python -m pytest -q -rs tests/gpu $(PYTEST_ARGS)

# Long fuzzing of the engines (not in `make test`, which runs a short pass of each): schemathesis over every route of
# contracts/openapi.json (FUZZ_EXAMPLES per operation) and the stateful walk (FUZZ_STEPS), against the embedded
# engine and vLLM's front where vLLM is installed. FUZZ_SEED is printed; rerun with it to replay a failure.
FUZZ_EXAMPLES ?= 600
FUZZ_STEPS ?= 5000
FUZZ_SEED ?= $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
fuzz: install-vllm-optional
	@echo "make fuzz: seed $(FUZZ_SEED) ($(FUZZ_EXAMPLES) examples per operation, $(FUZZ_STEPS) stateful steps)"
	PIPELINERL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PIPELINERL_FUZZ_STEPS=$(FUZZ_STEPS) PIPELINERL_FUZZ_SEED=$(FUZZ_SEED) \
	  $(BIN)/python -m pytest -q -s tests/test_fuzz.py tests/test_fuzz_stateful.py $(PYTEST_ARGS)

# Whole runs under random faults (tests/chaos.py): CHAOS_SEEDS runs of CHAOS_STEPS steps, CHAOS_FAULTS faults each;
# prints runs survived / faults injected. Root (for the full-disk fault's tmpfs) where available.
CHAOS_SEEDS ?= 1,2,3
CHAOS_STEPS ?= 200
CHAOS_FAULTS ?= 12
chaos: $(STAMP)
	PIPELINERL_CHAOS_SEEDS=$(CHAOS_SEEDS) PIPELINERL_CHAOS_STEPS=$(CHAOS_STEPS) PIPELINERL_CHAOS_FAULTS=$(CHAOS_FAULTS) \
	  $(BIN)/python -m pytest -q -s tests/test_chaos.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

# ruff, and the package's layers (tests/test_layers.py: no module imports from a layer above its own)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py

format: $(STAMP)
	$(BIN)/ruff format .

openapi: $(STAMP)
	$(BIN)/python -m pipelinerl.contracts.openapi > contracts/openapi.json

# docs/config_reference.md from the config's dataclasses and their comments (tests/test_contract.py checks it fresh)
config-reference: $(STAMP)
	$(BIN)/python -m pipelinerl.config_reference > docs/config_reference.md

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
