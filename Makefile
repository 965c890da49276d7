# hpc_ddp developer interface; CI (.ci/run) calls these same targets.
#
#   make local-test            train the default config on NPROC local CPU ranks (gloo)
#   make test                  the test suite: both tiers (Slurm tests skip unless a cluster is up)
#   make test-fast             the fast tier: the tests that start no process (a minute or so)
#   make test-e2e              the end-to-end tier: real ranks, real Slurm, real servers
#   make test-all              the test suite and the tests marked slow
#   make cluster-up            start the test Slurm cluster (root; installs Debian packages);
#                              NODES=16 starts 16 nodes of 2 CPUs (default 3)
#   make test-slurm            only the Slurm tests, failing if no cluster is up
#   make cluster-down          stop the test cluster
#   make install TORCH=...     (re)install; TORCH is the pip requirement for torch
#   make lint / make format
#   make bench                 the benchmarks; figures go to bench/README.md

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build by default. On a GPU cluster pass the CUDA build, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH ?= torch==2.13.0
NPROC ?= 2
NODES ?= 3
CONFIG ?= configs/digits.yaml
ARGS ?=
PYTEST_ARGS ?=

STAMP := $(VENV)/.installed

.PHONY: install local-test test test-fast test-e2e test-all test-slurm lint format clean cluster-up cluster-down parquet-data bench

# torch first and pinned, so the package's unpinned `torch` requirement is already met and pip
# never fetches the multi-GB CUDA wheels on a CPU machine.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install:
	rm -f $(STAMP)
	$(MAKE) $(STAMP) TORCH="$(TORCH)"

local-test: $(STAMP)
	$(BIN)/hpc-ddp local --nproc $(NPROC) --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e and not slurm" $(PYTEST_ARGS)

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -m "e2e or slurm" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest --slow $(PYTEST_ARGS)

test-slurm: $(STAMP)
	HPC_DDP_REQUIRE_SLURM=1 $(BIN)/python -m pytest -m slurm $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

parquet-data: $(STAMP)
	$(BIN)/hpc-ddp data make --kind synthetic --rows 200000 --row-group-size 4096 --files 4 \
		--out data/synthetic-parquet

cluster-up:
	$(PYTHON) tests/cluster/cluster.py up --nodes $(NODES)

cluster-down:
	$(PYTHON) tests/cluster/cluster.py down

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .cluster
