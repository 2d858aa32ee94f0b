#!/usr/bin/env bash
# Fill .carry/export/ (git-ignored) with what the export_7b case (bench/export/export_7b.sh) needs on a GPU machine
# without network beside .carry/wheels (bench/transport/wheels.sh): llama-cpp-python's wheel as the Makefile built it here (PyPI has only its
# source archive), gguf and diskcache (missing from the device image), llama.cpp's converter as a trimmed source
# archive that `python -m snaketune.export.llama_cpp install` takes, the real DeepSeek tokenizer's two files, the
# oasst rows, and libgomp (used only where the image lacks one). bench/transport/setup.sh installs and points the
# case at them there. Run HERE, from the repo root, after `make` (its llama-cpp-python build):
#
#   SNAKETUNE_BENCH_TOKENIZER=DIR SNAKETUNE_BENCH_ROWS=FILE bash bench/transport/export_files.sh
#
# The folder must stay under 28 MiB: with the wheels (33 MB without pulp and bitsandbytes) a call carries 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TOKENIZER=${SNAKETUNE_BENCH_TOKENIZER:?a directory with the tokenizer.json and tokenizer_config.json of deepseek-llm-7b-base}
ROWS=${SNAKETUNE_BENCH_ROWS:?oasst rows as .jsonl (bench/transport/real_rows.py)}
D=.carry/export
mkdir -p .carry
X=$(git rev-parse --git-path info/exclude); grep -qsx "/.carry/" "$X" || echo "/.carry/" >>"$X"  # the carried folders stay untracked
rm -rf "$D"
mkdir -p "$D/tokenizer" "$D/lib"

V=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' workflow/snaketune/export/llama_cpp.py)
# The newest build of the Makefile's wheel in pip's cache (the same as .venv's llama_cpp).
W=$(ls -t ~/.cache/pip/wheels/*/*/*/*/"llama_cpp_python-$V-py3-none-linux_x86_64.whl" | head -1)
cp "$W" "$D/"
GGUF=$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$D" "gguf==$GGUF" \
  "$(grep -E '^diskcache==' requirements-export.txt)"
# What install_converter extracts, under the sdist's own layout (llama_cpp_python-V/vendor/llama.cpp/...).
tar -cJf "$D/llama_cpp_python-$V-converter.tar.xz" --exclude=__pycache__ -C .venv/share \
  --transform "s,^llama.cpp-$V,llama_cpp_python-$V/vendor/llama.cpp," "llama.cpp-$V"
cp "$TOKENIZER/tokenizer.json" "$TOKENIZER/tokenizer_config.json" "$D/tokenizer/"
xz -6 -c "$ROWS" >"$D/oasst_real.hf_rows.jsonl.xz"  # setup.sh unpacks it there
cp "$(ldconfig -p | awk '/libgomp.so.1 .*x86-64/ {print $NF; exit}')" "$D/lib/libgomp.so.1"
chmod -R u+w "$D"

ls -la "$D" "$D/tokenizer" "$D/lib"
total=$(du -sb "$D" | cut -f1)
echo "$D: $((total / 1024)) KiB; with .carry/wheels: $((($(du -sb .carry/wheels 2>/dev/null | cut -f1) + total) / 1048576)) MiB"
[ "$total" -lt $((28 * 1048576)) ] || { echo "too large: $D must stay under 28 MiB"; exit 1; }
