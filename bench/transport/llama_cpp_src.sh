#!/usr/bin/env bash
# Fill .carry/llama_cpp_src/ (git-ignored) with what the gguf_gpu case (bench/export/gguf_gpu.sh) builds on a GPU
# machine without network: the llama.cpp that
# requirements-export.txt pins (vendored in llama-cpp-python's source archive, as the Makefile builds it), trimmed to
# what a CUDA build of libllama and llama-bench reads. The archive is 77 MB; without the vocabulary files, docs,
# tests, examples, the server and the other backends it is about 4 MB as xz. Run HERE, from the repo root:
#
#   bash bench/transport/llama_cpp_src.sh          # SDIST=path/to/llama_cpp_python-V.tar.gz, else pip downloads it
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
D=.carry/llama_cpp_src
mkdir -p .carry
X=$(git rev-parse --git-path info/exclude); grep -qsx "/.carry/" "$X" || echo "/.carry/" >>"$X"  # the carried folders stay untracked
V=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' workflow/snaketune/export/llama_cpp.py)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
SDIST=${SDIST:-}
if [ -z "$SDIST" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$TMP" "llama-cpp-python==$V"
    SDIST=$TMP/llama_cpp_python-$V.tar.gz
fi
tar xzf "$SDIST" -C "$TMP"
rm -rf "$D" && mkdir -p "$D"
L=llama_cpp_python-$V/vendor/llama.cpp
EXCLUDE=(models docs media tests benches examples tools/ui tools/server)
for b in metal sycl vulkan opencl hexagon et cann musa hip webgpu zdnn openvino blas rpc virtgpu zendnn; do
    EXCLUDE+=("ggml/src/ggml-$b")
done
tar -cJf "$D/llama.cpp-$V-src.tar.xz" -C "$TMP" "${EXCLUDE[@]/#/--exclude=$L/}" "$L"
ls -la "$D"
