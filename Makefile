# megadlms — convenience targets. Everything installs itself; nothing needs a GPU.
#   make install   venv (if none is active) + pinned CPU torch (if torch is missing) + package
#   make test      the whole test suite (the README's test command, what CI runs)
#   make test-fast the inner loop: every single-process test plus one multi-rank smoke per
#                  wrapper and parallel dimension (tests/tiers.py); the rest is marked slow
#   make demo      install + preprocess the KJV corpus + train a small DLM on 2 CPU ranks + sample
#   make cuda-check  compile every CUDA source with nvcc (no GPU needed)
#   make glue-check  syntax-check the torch-facing CUDA glue and bindings as a CUDA build
#                    compiles them (C++17, MEGADLM_WITH_CUDA; the toolkit's cuBLAS/cuSPARSE/
#                    cuSOLVER headers if present, else stubs in tools/cuda_stubs/mathlibs)
#   make lint      ruff (lint + format check), mypy over python/megadlms, clang-format (check)
#                  — what CI runs
#   make gpu-check   on a GPU machine, offline: build with CUDA, figures table, GPU tests,
#                    memcheck under an 8-minute budget (tools/gpu_check.sh; installs nothing
#                    from an index; GPU_CHECK_ARGS="--dry-run" or "--budget 6")

TORCH_SPEC ?= torch==2.13.0
ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := $(CURDIR)/.venv/bin/python
endif
export MAX_JOBS ?= 2
export CFLAGS ?= -g0
PYTEST_ARGS ?=
# tests/tiers.py marks `slow` every test that starts ranks or a launcher, except its SMOKE list
# Without bytecode caches (PYTHONDONTWRITEBYTECODE, set in some images, with a venv installed
# without compiling) every rank, launcher and CLI process recompiles torch from source: ~3x the
# CPU of each import. The suite writes the caches (tests/conftest.py does it for direct runs).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -p tests.tiers

# The install is redone only when the build inputs change (a stamp inside the venv), so
# `make test` / `make demo` after the first run start at once.
STAMP := $(dir $(PY)).megadlms-installed
BUILD_INPUTS := setup.py pyproject.toml $(shell find csrc megadlm_ext -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) 2>/dev/null)

.PHONY: install test test-fast demo bench cuda-check glue-check gpu-check lint format clean

$(PY):
	python3 -m venv $(CURDIR)/.venv

$(STAMP): $(PY) $(BUILD_INPUTS)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -q setuptools wheel ninja
	$(PY) -m pip install --no-build-isolation -e ".[test,demo,hf,tensorboard,wandb]"
	@$(PY) -c "import megadlm_ext as e; i = e.backend_info(); assert i['compiled'], i; print('megadlm_ext:', i)"
	@touch $@

install: $(STAMP)

test: install
	$(PYTEST) tests $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) tests -m "not slow" $(PYTEST_ARGS)

demo: install
	PY=$(PY) bash examples/demo.sh

bench: install
	$(PY) benchmarks/bench_ext.py

RUFF_SPEC ?= ruff==0.17.6
CLANG_FORMAT_SPEC ?= clang-format==19.1.7
MYPY_SPEC ?= mypy==2.4.1
CSRC := $(shell find csrc tests/ext -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null)

lint: $(PY)
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) -m pip install -q "$(RUFF_SPEC)"
	@$(dir $(PY))clang-format --version >/dev/null 2>&1 || $(PY) -m pip install -q "$(CLANG_FORMAT_SPEC)"
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@$(PY) -m mypy --version 2>/dev/null | grep -q "$(subst mypy==,,$(MYPY_SPEC))" || $(PY) -m pip install -q "$(MYPY_SPEC)"
	$(PY) -m mypy   # settings in pyproject.toml ([tool.mypy]: python/megadlms)
	$(dir $(PY))clang-format --dry-run -Werror $(CSRC)

format: $(PY)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
	$(dir $(PY))clang-format -i $(CSRC)

cuda-check:
	cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cmake -j $(MAX_JOBS)

# The CUDA build's torch-facing translation units, which a CPU build never compiles: checked
# with g++ -std=c++17 -fsyntax-only (torch 2.11's standard) against the installed torch's
# headers and the CUDA toolkit's, with the real cuBLAS / cuSPARSE / cuSOLVER headers where
# this machine has them, else tools/cuda_stubs/mathlibs (tools/glue_check.sh says which).
glue-check: install
	PY="$(PY)" MAX_JOBS="$(MAX_JOBS)" bash tools/glue_check.sh

# No `install` prerequisite: on a GPU box the python that holds torch is used as it is
# (the script finds it; GPU_CHECK_PY= picks one) and the script builds with all cores.
GPU_CHECK_ARGS ?=
GPU_CHECK_PY ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV)/bin/python,)
gpu-check:
	PY="$(GPU_CHECK_PY)" bash tools/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf build megadlm_ext/_C*.so *.egg-info python/*.egg-info $(STAMP)
