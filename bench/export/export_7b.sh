# The export stage on the full-size deepseek-llm-7b architecture (random bf16 weights) on the lent H200:
# bench/export_7b.py's build phase (data stages + the model built on the GPU and saved) and export phase
# (snaketune.export.export: converter, q8_0 and q4_k_m, scoring, all on the CPU). Run from the repo root, carrying
# .whl2 (bench/prepare_device_wheels.sh) and .x25 (bench/prepare_export_7b.sh):
#
#   PHASE=all bash bench/device_export_7b.sh     # install, then build and export in a detached job
#   PHASE=wait bash bench/device_export_7b.sh    # a later call on the same (warm) machine: wait for that job
#
# The job runs in its own process session (setsid), so it outlives a call that returns first; each call waits at
# most WAIT_S seconds from its start (default 540, inside the 600 s limit), then leaves its log and one archive of
# the results in $OUT (no weights, no GGUF files). Everything that must survive between calls is in /tmp/export7b.
# PHASE=build or PHASE=export run one phase; LAYERS, EVAL_TOKENS, THREADS and ARGS (more driver flags) pass through;
# INSTALL=0 skips the pip install (a machine that has /tmp/site already, or a test elsewhere).
set -uo pipefail
PHASE=${PHASE:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; exec > >(tee -a "$OUT/device_export_7b_$PHASE.log") 2>&1
R=$PWD
W=${WORK:-/tmp/export7b}
X=$R/.x25
WAIT_S=${WAIT_S:-540}
mkdir -p "$W"
V=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' workflow/snaketune/export/llama_cpp.py)
export PYTHONPATH=/tmp/site:$R/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SNAKETUNE_LLAMA_CPP_CONVERTER=$W/llama.cpp-$V
echo "=== $(date -u +%T) phase $PHASE, $(git log -1 --format='commit %H %s' 2>/dev/null)"
# libllama's OpenMP: the image's, else the carried one.
ldconfig -p 2>/dev/null | grep -q 'libgomp.so.1 ' || export LD_LIBRARY_PATH=$X/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

if [ "$PHASE" != wait ]; then
    if [ "${INSTALL:-1}" = 1 ] && [ ! -f /tmp/site/.export7b ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl2/*.whl "$X"/*.whl || exit 1
        touch /tmp/site/.export7b
    fi
    # llama.cpp's converter, as the Makefile installs it (from the trimmed source archive).
    [ -f "$SNAKETUNE_LLAMA_CPP_CONVERTER/convert_hf_to_gguf.py" ] ||
        python3 -m snaketune.export.llama_cpp install "$X/llama_cpp_python-$V-converter.tar.xz" || exit 1
    cp -r "$X/tokenizer" "$X/en_100.hf_rows.jsonl" "$W/"
    nvidia-smi; free -g; nproc; df -h /tmp
    python3 -c 'import importlib.metadata as m, torch, llama_cpp; print({p: m.version(p) for p in ("torch", "transformers", "llama_cpp_python", "gguf")}, "cuda", torch.cuda.is_available())' || exit 1
fi

case $PHASE in
    all) STEPS="build export" ;;
    build | export) STEPS=$PHASE ;;
    wait) STEPS= ;;
    *) echo "unknown phase $PHASE"; exit 2 ;;
esac
if [ -n "$STEPS" ] && [ -f "$W/job.log" ] && [ ! -f "$W/job.rc" ]; then
    echo "a job started by an earlier call is still running: waiting for it instead"; STEPS=
fi
if [ -n "$STEPS" ]; then
    TIME=; [ -x /usr/bin/time ] && TIME="/usr/bin/time -v"
    rm -f "$W/job.rc"; touch "$W/job.log"
    DRIVER="python3 $R/bench/export_7b.py --out $W/out --tokenizer $W/tokenizer --data $W/en_100.hf_rows.jsonl \
        --threads ${THREADS:-$(nproc)} ${LAYERS:+--num-layers $LAYERS} ${EVAL_TOKENS:+--eval-tokens $EVAL_TOKENS} ${ARGS:-}"
    # One process per phase (each phase's peak memory is its own); the first failure ends the job.
    setsid bash -c "cd $R; for s in $STEPS; do echo \"=== \$(date -u +%T) \$s\"; $TIME $DRIVER --phase \$s || \
        { echo \$? > $W/job.rc; exit; }; done; echo 0 > $W/job.rc" >>"$W/job.log" 2>&1 </dev/null &
fi
[ -f "$W/job.log" ] || { echo "no job in $W: start one with PHASE=all"; exit 2; }
while [ ! -f "$W/job.rc" ] && [ "$SECONDS" -lt "$WAIT_S" ]; do sleep 5; done
grep -v -e '^INFO:hf-to-gguf' -e '^llama_model_quantize' -e '^\[ *[0-9]*/ *[0-9]*\]' -e 'it/s\]' "$W/job.log" | tail -60
grep -E '^20[0-9-]+ [0-9:,]+ ' "$W/out/export.log" 2>/dev/null | cut -c1-300 | tail -20
free -g
if [ -f "$W/job.rc" ]; then echo "=== $(date -u +%T) job exit $(cat "$W/job.rc")"; else
    echo "=== $(date -u +%T) job still running after ${SECONDS}s: call again at once with PHASE=wait"; fi
# At most 8 files come back: this log, the report, and one archive of the rest (no weights, no GGUF files).
cp "$W/out/export_7b.json" "$OUT/" 2>/dev/null
tar czf "$OUT/export_7b_$PHASE.tgz" -C "$W" --exclude='*.safetensors' --exclude='*.gguf' --exclude='*.arrow' \
    --exclude="*.parquet" --exclude=tokenizer.json job.log out 2>/dev/null
ls -la "$OUT"
