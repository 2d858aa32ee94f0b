#!/usr/bin/env bash
# Fill .carry/lmeval/ (git-ignored) with what the benchmark stage needs on a GPU machine without network beside
# .carry/wheels (wheels.sh) and .carry/export (export_files.sh, llama-cpp-python): lm-evaluation-harness and its
# closure, and llama-cpp-python's server extra, at the versions .venv has (requirements-benchmark.txt). Pure-Python
# packages as this machine builds or fetches them, compiled ones for the device's CPython 3.12. 28 MiB: carry it in a
# call of its own or with one GGUF part. Run HERE, from the repo root, after `make`:
#
#   bash bench/transport/benchmark_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
D=${DEST:-.carry/lmeval}
mkdir -p "$D"
X=$(git rev-parse --git-path info/exclude); grep -qsx "/.carry/" "$X" || echo "/.carry/" >>"$X"
pinned() { for p in "$@"; do echo "$p==$("$PIP" show "$p" | awk '/^Version:/ {print $2}')"; done; }
# Pure Python (py3-none-any wheels, built here where PyPI has only a source archive).
PURE=(lm-eval evaluate pytablewriter dataproperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet
  rouge-score sacrebleu portalocker tabulate colorama word2number sqlitedict absl-py nltk joblib threadpoolctl
  langdetect immutabledict uvicorn fastapi starlette sse-starlette starlette-context pydantic-settings anyio h11
  click python-dotenv sniffio opentelemetry-api)
"$PIP" wheel -q --no-deps -w "$D" $(pinned "${PURE[@]}")
# Compiled, for the device's CPython 3.12.
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$D" $(pinned scikit-learn lxml)
echo "$D: $(ls "$D" | wc -l) wheels, $(( $(du -sb "$D" | cut -f1) / 1048576 )) MiB"
