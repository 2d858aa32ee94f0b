# The 4-bit states' rounding on CPU ranks (issue #26; configs/in_backward_tiny.yaml): the experiments named (default
# fp32_states in_backward_4bit in_backward_4bit_nearest in_backward_fp32) side by side, each in its own copy of the
# workflow in $OUT (those named after a variant edited by states_variant.sh), then states_rounding.py's table of
# losses against fp32_states. $EXTRA: more --configfile files (another seed: a file with train.seed). ~1.5 min on
# 2 cores:
#   python -m bench converge_cpu_tiny [EXPERIMENT ...]
set -uo pipefail
R=$PWD
OUT=${OUT:-/tmp/states_rounding}; mkdir -p "$OUT"
PY=${PYTHON:-$R/.venv/bin/python}
pids=()
for e in ${*:-${EXPERIMENTS:-fp32_states in_backward_4bit in_backward_4bit_nearest in_backward_fp32}}; do
    d=$OUT/wf_$e; rm -rf $d; mkdir -p $d
    cp -r Snakefile workflow config envs $d/
    bash bench/convergence/states_variant.sh $d $e || exit 1
    (cd $d && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks $PY -m snakemake results/train/$e/summary.json --cores 1 \
        --configfile $R/bench/convergence/configs/in_backward_tiny.yaml ${EXTRA:-} > "$OUT/$e.log" 2>&1
     echo "=== $(date -u +%T) $e exit $?") &
    pids+=($!)
done
wait "${pids[@]}"
$PY bench/convergence/states_rounding.py "$OUT"/wf_*/results/train/*/metrics.csv
