# bpclip_fast developer entry points. On a fresh clone `make test` / `make demo` do everything:
# create .venv, install the pinned dependencies, build the extension, run.
#
#   make venv       .venv + requirements-dev.txt (stamp file: re-runs are instant). No pip cache:
#                   the CUDA build of torch and its libraries are several GB, and a second copy in
#                   ~/.cache/pip once filled a CI machine's disk.
#   make build      build bpclip_fast._C (incremental; rebuilt when csrc/, setup.py,
#                   tools/cuda_archs.py or switches change)
#   make test       build, pytest, then the C++ tests (cmake + ctest in build/cmake)
#   make cpp-test   only the C++ tests: header-only (csrc/include), so cmake builds just them; needs
#                   no .venv, Torch or CUDA. BPCLIP_CMAKE_LIBRARY=ON also builds the library from
#                   csrc/ in cmake (IDEs, tests/cpp/*_torch.cpp; needs .venv): a second compile of
#                   what `make build` compiles with setup.py.
#   make demo       build, then python -m bpclip_fast.demo
#   make clean      remove build outputs (keeps .venv);  make distclean also removes .venv
#
# Switches (environment or make variables): BPCLIP_CPU_ONLY=1, BPCLIP_FORCE_CUDA=1,
# TORCH_CUDA_ARCH_LIST (default 8.0;9.0, kept in tools/cuda_archs.py), CUDA_HOME, MAX_JOBS
# (default 2), BPCLIP_CMAKE_LIBRARY=ON (the library in the cmake build; default OFF),
# BPCLIP_CMAKE_CUDA=ON (the library with its CUDA sources in the cmake build; implies
# BPCLIP_CMAKE_LIBRARY=ON; default OFF), CMAKE_ARGS (extra cmake options).

SHELL := /bin/bash
.DEFAULT_GOAL := build

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := build/.ext-built
EDITABLE_STAMP := $(VENV)/.bpclip-editable
BUILD_CONFIG := build/.ext-config
CMAKE_DIR := build/cmake
BPCLIP_CMAKE_CUDA ?= OFF
BPCLIP_CMAKE_LIBRARY ?= $(BPCLIP_CMAKE_CUDA)
# Non-empty when the cmake build includes the library (CMake's spellings of true).
CMAKE_LIBRARY_ON := $(filter ON On on 1 TRUE True true YES Yes yes Y y,$(BPCLIP_CMAKE_LIBRARY))

export MAX_JOBS ?= 2
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDA_HOME ?= /usr/local/cuda
endif
export BPCLIP_CPU_ONLY BPCLIP_FORCE_CUDA TORCH_CUDA_ARCH_LIST BPCLIP_DEBUG

# Directories too: their mtime changes when a file is added or removed.
CSRC_FILES := $(shell find csrc -type f -o -type d 2>/dev/null)

.PHONY: venv build test pytest cpp-test demo clean distclean FORCE

venv: $(VENV_STAMP)

$(VENV_STAMP): requirements-dev.txt
	@test -x $(PY) || { echo "creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --no-cache-dir -r requirements-dev.txt
	@touch $@

# The switches that change what setup.py builds; the file is rewritten only when they change,
# so flipping BPCLIP_CPU_ONLY (etc.) triggers a rebuild and nothing else does.
$(BUILD_CONFIG): FORCE
	@mkdir -p $(@D)
	@cfg="CPU_ONLY=$(BPCLIP_CPU_ONLY) FORCE_CUDA=$(BPCLIP_FORCE_CUDA) ARCHS=$(TORCH_CUDA_ARCH_LIST) CUDA_HOME=$(CUDA_HOME) DEBUG=$(BPCLIP_DEBUG)"; \
	  [ -f $@ ] && [ "$$(cat $@)" = "$$cfg" ] || echo "$$cfg" > $@

build: $(BUILD_STAMP) $(EDITABLE_STAMP)

# Incremental: ninja keeps its objects in build/ext-{cpu,cuda} (see setup.py) and recompiles only
# what changed; bpclip_fast/_C*.so is written in place.
$(BUILD_STAMP): $(VENV_STAMP) $(BUILD_CONFIG) setup.py tools/cuda_archs.py pyproject.toml $(CSRC_FILES)
	$(PY) setup.py build_ext --inplace
	@touch $@

# Once per venv (and when the metadata changes): register the package in .venv as an editable
# install, so `import bpclip_fast` works from any directory. It reuses the objects above, so
# nothing is recompiled.
$(EDITABLE_STAMP): pyproject.toml | $(BUILD_STAMP)
	$(PY) -m pip install --no-build-isolation --no-deps -q -e .
	@touch $@

pytest: build
	$(PY) -m pytest -q tests

test: pytest cpp-test

# The library switch is always passed, so a build/cmake configured with it ON goes back to OFF.
# Python and Torch are looked up only for the library.
CMAKE_LIBRARY_ARGS = $(if $(CMAKE_LIBRARY_ON),-DBPCLIP_BUILD_LIBRARY=ON \
	-DPython3_EXECUTABLE="$(abspath $(PY))" \
	-DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')",-DBPCLIP_BUILD_LIBRARY=OFF)

cpp-test: $(if $(CMAKE_LIBRARY_ON),$(VENV_STAMP))
	cmake -S . -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_LIBRARY_ARGS) \
	  -DBPCLIP_CUDA=$(BPCLIP_CMAKE_CUDA) $(CMAKE_ARGS)
	cmake --build $(CMAKE_DIR) -j $(MAX_JOBS)
	cd $(CMAKE_DIR) && ctest --output-on-failure

demo: build
	$(PY) -m bpclip_fast.demo

clean:
	rm -rf build dist *.egg-info bpclip_fast/_C*.so .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

FORCE:
