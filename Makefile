# The two commands of the quick start: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all
GPUS ?= 3
SNAKEMAKE_ARGS ?=

.PHONY: run test lint format clean-results

$(STAMP): requirements.txt requirements-dev.txt requirements-kernels.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and alone: this exact version is the CPU build on a CPU-only machine here; on a GPU
	# machine pip picks the CUDA build of the same version.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt
	# GPU-only kernels, without their Triton requirement (torch's CUDA build brings Triton; the CPU build does
	# not and needs none): requirements-kernels.txt.
	$(BIN)/pip install --quiet --no-deps -r requirements-kernels.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --resources gpu=$(GPUS) $(SNAKEMAKE_ARGS)

test: $(STAMP) lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
