#!/usr/bin/env bash
# The export stage on the full-size deepseek-llm-7b architecture (random bf16 weights): export_7b.py's build phase
# (data stages on SNAKETUNE_BENCH_ROWS with the real tokenizer SNAKETUNE_BENCH_TOKENIZER, the model built on the GPU
# where there is one, and saved) and export phase (snaketune.export.export: converter, q8_0 and q4_k_m, scoring, all
# on the CPU, with the llama.cpp the project pins; SNAKETUNE_LLAMA_CPP_CONVERTER where the converter is elsewhere).
#
#   python -m bench export_7b [all|build|export]   start the phases (default all) in a detached job, wait for it
#   python -m bench export_7b wait                 a later call on the same machine: wait for that job
#
# The job runs in its own process session (setsid), so it outlives a call that returns first (a lent machine's
# command limit); each call waits at most WAIT_S seconds (default 540), then leaves the job's log, export_7b.json
# and one archive of the results in $OUT (no weights, no GGUF files). What must survive between calls is in $WORK
# (default /tmp/export7b). LAYERS, EVAL_TOKENS, THREADS and ARGS (more export_7b.py flags, e.g.
# ARGS="--config bench/export/configs/export_7b.yaml") pass through.
set -uo pipefail
PHASE=${1:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$PWD
W=${WORK:-/tmp/export7b}
WAIT_S=${WAIT_S:-540}
mkdir -p "$W"
echo "=== $(date -u +%T) phase $PHASE"
case $PHASE in
    all) STEPS="build export" ;;
    build | export) STEPS=$PHASE ;;
    wait) STEPS= ;;
    *) echo "unknown phase $PHASE: all, build, export or wait"; exit 2 ;;
esac
if [ -n "$STEPS" ]; then
    python3 -c 'import importlib.metadata as m, torch; print({p: m.version(p) for p in ("torch", "transformers", "llama_cpp_python", "gguf")}, "cuda", torch.cuda.is_available())' || exit 1
    free -g; nproc; df -h "$W"
fi
if [ -n "$STEPS" ] && [ -f "$W/job.log" ] && [ ! -f "$W/job.rc" ]; then
    echo "a job started by an earlier call is still running: waiting for it instead"; STEPS=
fi
if [ -n "$STEPS" ]; then
    TIME=; [ -x /usr/bin/time ] && TIME="/usr/bin/time -v"
    rm -f "$W/job.rc"; : >"$W/job.log"
    DRIVER="python3 $R/bench/export/export_7b.py --out $W/out --tokenizer $SNAKETUNE_BENCH_TOKENIZER \
        --data $SNAKETUNE_BENCH_ROWS --threads ${THREADS:-$(nproc)} ${LAYERS:+--num-layers $LAYERS} \
        ${EVAL_TOKENS:+--eval-tokens $EVAL_TOKENS} ${ARGS:-}"
    # One process per phase (each phase's peak memory is its own); the first failure ends the job.
    setsid bash -c "cd $R; for s in $STEPS; do echo \"=== \$(date -u +%T) \$s\"; $TIME $DRIVER --phase \$s || \
        { echo \$? > $W/job.rc; exit; }; done; echo 0 > $W/job.rc" >>"$W/job.log" 2>&1 </dev/null &
fi
[ -f "$W/job.log" ] || { echo "no job in $W: start one with phase all"; exit 2; }
while [ ! -f "$W/job.rc" ] && [ "$SECONDS" -lt "$WAIT_S" ]; do sleep 5; done
grep -v -e '^INFO:hf-to-gguf' -e '^llama_model_quantize' -e '^\[ *[0-9]*/ *[0-9]*\]' -e 'it/s\]' "$W/job.log" | tail -60
grep -E '^20[0-9-]+ [0-9:,]+ ' "$W/out/export.log" 2>/dev/null | cut -c1-300 | tail -20
free -g
cp "$W/out/export_7b.json" "$OUT/" 2>/dev/null
tar czf "$OUT/export_7b_$PHASE.tgz" -C "$W" --exclude='*.safetensors' --exclude='*.gguf' --exclude='*.arrow' \
    --exclude="*.parquet" --exclude=tokenizer.json job.log out 2>/dev/null
if [ -f "$W/job.rc" ]; then echo "=== $(date -u +%T) job exit $(cat "$W/job.rc")"; exit "$(cat "$W/job.rc")"; fi
echo "=== $(date -u +%T) job still running after ${SECONDS}s: run \`python -m bench export_7b wait\` on this machine"
