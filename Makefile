# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
#
# torch is installed first, pinned, so that pip never resolves a bare "torch"
# by itself: on a CPU-only machine that carries a local CPU wheel (this one),
# `pip install torch==$(TORCH_VERSION)` takes it in seconds; on a GPU machine
# the same line takes PyPI's CUDA build. Override with e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#
# Python writes the bytecode of what it imports, even where the environment sets
# PYTHONDONTWRITEBYTECODE (as CI's does): so pip need not compile every installed file of
# torch and transformers up front (--no-compile), most of which are never imported.
unexport PYTHONDONTWRITEBYTECODE

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-compile -e ".[viz,test]"
	$(BIN)/python -m pipesched.runtime.compat.native_rng
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports --no-logo

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/schedule_build.py
	$(BIN)/python benchmarks/local_cpu.py
	$(BIN)/python benchmarks/distributed_cpu.py

# Every CUDA test, the local runtime on the GPUs (vs torchgpipe) and NCCL pp=2, as one
# table; without CUDA one line saying so, exit 0. On a GPU machine install the CUDA build:
#   make gpu-check TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
