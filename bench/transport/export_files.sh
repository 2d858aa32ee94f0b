#!/usr/bin/env bash
# Fill .x25/ (git-ignored) with what bench/device_export_7b.sh needs on the lent H200 beside .whl2 (which
# bench/prepare_device_wheels.sh fills): llama-cpp-python's wheel as the Makefile built it here (PyPI has only its
# source archive), gguf and diskcache (missing from the device image), llama.cpp's converter as a trimmed source
# archive that `python -m snaketune.export.llama_cpp install` takes, the real DeepSeek tokenizer's two files, the
# oasst rows, and libgomp (used only where the image lacks one). Run HERE, from the repo root:
#
#   bash bench/prepare_export_7b.sh
#
# .x25 must stay under 28 MiB: with .whl2 (33 MB) a call's carried payload is at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TOKENIZER=${TOKENIZER:-../shared/realdata/deepseek-llm-7b-base}
ROWS=${ROWS:-../shared/realdata/oasst/en_100.hf_rows.jsonl}
D=.x25
grep -qsx '/.x25/' .git/info/exclude || echo '/.x25/' >>.git/info/exclude
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
cp "$ROWS" "$D/"
cp "$(ldconfig -p | awk '/libgomp.so.1 .*x86-64/ {print $NF; exit}')" "$D/lib/libgomp.so.1"
chmod -R u+w "$D"

ls -la "$D" "$D/tokenizer" "$D/lib"
total=$(du -sb "$D" | cut -f1)
echo "$D: $((total / 1024)) KiB; with .whl2: $((($(du -sb .whl2 | cut -f1) + total) / 1048576)) MiB"
[ "$total" -lt $((28 * 1048576)) ] || { echo "too large: $D must stay under 28 MiB"; exit 1; }
