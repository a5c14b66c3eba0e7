# Fresh machine: `make run` or `make test`. Both create .venv and install everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: run test lint typecheck unit sysdeps bench clean

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first and pinned: a CPU wheel here; nothing later may pull a CUDA build.
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[dev]"
	# The cookbook's tests drive our service; see pyproject's dev extra for why --no-deps.
	$(BIN)/pip install -q --no-deps "tinker-cookbook==0.6.1"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/inflight run blackjack

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# redis-server, PostgreSQL and bubblewrap, which the tests start themselves: installed where this can (root
# with apt-get), else one line naming what to install.
sysdeps:
	bash scripts/sysdeps.sh

# Two workers (pytest-xdist), each running whole files, so that a module's fixtures (a file's private Ray,
# its server) stay one per file. In one process the suite leaves about half of two cores idle, waiting on
# servers, subprocesses and deadlines (docs/benchmarks.md, "The test suite on two workers").
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

unit: $(STAMP) sysdeps
	$(BIN)/pytest -q --durations=40 -n $(TEST_WORKERS) --dist loadfile

test: lint typecheck unit

clean:
	rm -rf $(VENV) runs
