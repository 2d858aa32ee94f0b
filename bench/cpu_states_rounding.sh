# The 4-bit states' rounding on CPU ranks (issue #26; bench/configs/in_backward_tiny.yaml): the experiments side by
# side, each in its own copy of the workflow (in_backward_4bit_nearest's copy edited as bench/configs/in_backward_tiny.yaml says), then
# bench/states_rounding.py's table of training and validation losses against fp32_states. From the repo root:
#   bash bench/cpu_states_rounding.sh [OUT]
set -uo pipefail
R=$PWD
OUT=${1:-/tmp/states_rounding}; mkdir -p "$OUT"
PY=${PYTHON:-$R/.venv/bin/python}
pids=()
for e in ${EXPERIMENTS:-fp32_states in_backward_4bit in_backward_4bit_nearest in_backward_4bit_square in_backward_fp32}; do
    d=$OUT/wf_$e; rm -rf $d; mkdir -p $d
    cp -r Snakefile workflow config envs $d/
    [ $e = in_backward_4bit_nearest ] && sed -i 's/^ROUNDING = "stochastic"$/ROUNDING = "nearest"/' $d/workflow/snaketune/train/states4bit.py
    [ $e = in_backward_4bit_square ] && sed -i 's/^V_MAP_4BIT = "linear"$/V_MAP_4BIT = "square"/' $d/workflow/snaketune/train/backward_step.py
    case $e in *sqrt*) sed -i 's/^V_DOMAIN = "v"$/V_DOMAIN = "sqrt"/' $d/workflow/snaketune/train/states4bit.py ;; esac
    case $e in *square*) sed -i 's/^V_MAP_4BIT = "linear"$/V_MAP_4BIT = "square"/' $d/workflow/snaketune/train/backward_step.py ;; esac
    grep -Hn '^V_DOMAIN\|^ROUNDING\|^V_MAP_4BIT' $d/workflow/snaketune/train/states4bit.py $d/workflow/snaketune/train/backward_step.py
    (cd $d && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks $PY -m snakemake results/train/$e/summary.json --cores 1 --configfile $R/bench/configs/in_backward_tiny.yaml ${EXTRA:-} \
        > "$OUT/$e.log" 2>&1; echo "=== $(date -u +%T) $e exit $?") &
    pids+=($!)
done
wait "${pids[@]}"
$PY bench/states_rounding.py "$OUT"/wf_*/results/train/*/metrics.csv
