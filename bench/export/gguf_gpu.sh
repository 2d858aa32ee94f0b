#!/usr/bin/env bash
# Issue #25's GPU figures: the llama.cpp that the export stage pins (llama-cpp-python 0.3.36's vendored copy,
# requirements-export.txt), built with CUDA, and its own benchmark tool (llama-bench) on the export stage's GGUF files
# of the 7B architecture (`python -m bench export_7b` writes them into /tmp/export7b/out; FILES=DIR for others).
# Two phases on one machine (it keeps /tmp):
#
#   python -m bench gguf_gpu build    # start the CUDA build, detached (setsid): it goes on after the call returns
#   python -m bench gguf_gpu bench    # wait for the build, then llama-bench on every GGUF file under $FILES
#
# The source: $LLAMA_SRC, else the trimmed archive bench/transport/llama_cpp_src.sh makes (.carry/llama_cpp_src/),
# else the source archive `make` downloads (.venv/src/llama_cpp_python-V.tar.gz). The build is ggml's CUDA backend
# for this GPU's architecture only (CUDA_ARCH, default 90: H100/H200; a build for every architecture takes far
# longer) with llama.cpp's other defaults, a shared libllama and llama-bench; GGML_NATIVE=OFF as the Makefile builds
# the stage's CPU library, so that the CPU rows are the stage's machine code. llama-bench runs each file with every
# layer on the GPU (-ngl 99) and then on the CPU alone (-ngl 0, all cores): prompt processing of 512 tokens (pp512)
# and generation of 128 (tg128; 32 once on the CPU), the mean of REPS runs, as llama.cpp's tables report them.
set -uo pipefail
PHASE=${1:?usage: python -m bench gguf_gpu build|bench}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$PWD
B=/tmp/lcpp
V=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' workflow/snaketune/export/llama_cpp.py)
SRC=$B/llama_cpp_python-$V/vendor/llama.cpp
FILES=${FILES:-/tmp/export7b/out}
REPS=${REPS:-3}
WAIT_S=${WAIT_S:-540}
echo "=== $(date -u +%T) phase $PHASE"
case $PHASE in
build)
    LLAMA_SRC=${LLAMA_SRC:-$(ls "$R/.carry/llama_cpp_src/llama.cpp-$V-src.tar.xz" "$R/.x25gpu/llama.cpp-$V-src.tar.xz" \
        "$R/.venv/src/llama_cpp_python-$V.tar.gz" 2>/dev/null | head -1)}
    [ -f "$LLAMA_SRC" ] || { echo "no llama.cpp source: set LLAMA_SRC (bench/transport/llama_cpp_src.sh)"; exit 2; }
    mkdir -p $B && tar xf "$LLAMA_SRC" -C $B || exit 1
    nvcc --version | tail -2; cmake --version | head -1; nproc
    rm -f $B/build.rc
    setsid bash -c "cd $SRC && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        && /usr/bin/time -v cmake --build build -j $(nproc) --target llama-bench; echo \$? > $B/build.rc" \
        > $B/build.log 2>&1 < /dev/null &
    sleep 20; tail -5 $B/build.log
    ;;
bench)
    while [ ! -f $B/build.rc ] && [ "$SECONDS" -lt "$WAIT_S" ]; do sleep 5; done
    grep -E "Elapsed|Maximum resident" $B/build.log; tail -3 $B/build.log
    [ "$(cat $B/build.rc 2>/dev/null)" = 0 ] || { echo "build not done or failed"; exit 1; }
    BIN=$SRC/build/bin
    J=$B/bench; rm -rf $J; mkdir -p $J  # llama-bench's files, one archive in $OUT (a call brings back 8 files)
    export LD_LIBRARY_PATH=$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ls -la "$FILES"/*.gguf "$FILES"/*/*.gguf 2>/dev/null
    for f in $(ls "$FILES"/*.gguf "$FILES"/*/*.gguf 2>/dev/null); do
        n=$(basename "$f" .gguf)
        for ngl in 99 0; do
            echo "=== $(date -u +%T) $n ngl $ngl"
            # The CPU rows (generation at a few tokens/s for the 7B) once, with 32 tokens generated.
            reps=$REPS gen=128; [ $ngl = 0 ] && reps=1 gen=32
            "$BIN/llama-bench" -m "$f" -ngl $ngl -t "$(nproc)" -p 512 -n $gen -r $reps -o json \
                > "$J/llama_bench_${n}_ngl$ngl.json" 2> "$J/llama_bench_${n}_ngl$ngl.err"
            python3 - "$J/llama_bench_${n}_ngl$ngl.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    print(f"{r['model_type']:>28} {r['model_size'] / 1e9:6.2f} GB ngl {r['n_gpu_layers']:>2} {test:>6}: "
          f"{r['avg_ts']:9.1f} +- {r['stddev_ts']:6.1f} tokens/s  ({r['backends']}, {r['gpu_info']})")
PY
            [ "$SECONDS" -lt "$WAIT_S" ] || { echo "out of time"; break 2; }
        done
    done
    tar czf "$OUT/llama_bench.tgz" -C $J .
    ;;
esac
