# The 4-bit states' rounding on CPU ranks (issue #26; bench/configs/in_backward_tiny.yaml): the experiments of
# $EXPERIMENTS side by side, each in its own copy of the workflow (those named after a variant edited by
# bench/states_variant.sh), then bench/states_rounding.py's table of losses against fp32_states. $EXTRA: more
# --configfile files (another seed: a file with train.seed). From the repo root, ~1.5 min on 2 cores:
#   bash bench/cpu_states_rounding.sh [OUT]
set -uo pipefail
R=$PWD
OUT=${1:-/tmp/states_rounding}; mkdir -p "$OUT"
PY=${PYTHON:-$R/.venv/bin/python}
pids=()
for e in ${EXPERIMENTS:-fp32_states in_backward_4bit in_backward_4bit_nearest in_backward_fp32}; do
    d=$OUT/wf_$e; rm -rf $d; mkdir -p $d
    cp -r Snakefile workflow config envs $d/
    bash bench/states_variant.sh $d $e || exit 1
    (cd $d && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks $PY -m snakemake results/train/$e/summary.json --cores 1 \
        --configfile $R/bench/configs/in_backward_tiny.yaml ${EXTRA:-} > "$OUT/$e.log" 2>&1
     echo "=== $(date -u +%T) $e exit $?") &
    pids+=($!)
done
wait "${pids[@]}"
$PY bench/states_rounding.py "$OUT"/wf_*/results/train/*/metrics.csv
