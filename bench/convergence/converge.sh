#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct, 50 SFT steps at its example's size (config/examples/smollm2-135m-real.yaml with
# real_model/configs/real_model.yaml and convergence/configs/in_backward_real.yaml: 32 packed rows of 1,024 tokens a
# step, lr 1e-4, warmup 3, cosine to 10%, clipping at 1.0): the experiments named (in_backward_real.yaml's; default
# fp32_adam and in_backward_4bit) side by side on the one GPU, the same batches in the same order, each in its own
# copy of the workflow under $WORK (those named after a variant of states_variant.sh edited by it), then
# states_rounding.py's table of their losses against fp32 Adam's (fp32_adam, where it runs; else fp32_states).
# Quality only: side by side, their times mean nothing. Device memory: fp32_adam 38 GiB, the others 17-22 GiB each.
#   python -m bench converge [fp32_adam] [fp32_states] [in_backward_4bit] [in_backward_fp32] [fp8] ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
WORK=${WORK:-/tmp/snaketune-converge}
EXPERIMENTS=${*:-fp32_adam in_backward_4bit}
rm -rf "$WORK" && mkdir -p "$WORK"
pids=()
for e in $EXPERIMENTS; do
    d=$WORK/wf_$e
    mkdir -p "$d/.realdata"
    cp -r Snakefile workflow config envs "$d/"
    bash bench/convergence/states_variant.sh "$d" "$e" || exit 1
    ln -s "$SNAKETUNE_BENCH_ROWS" "$d/.realdata/oasst_real.hf_rows.jsonl"
    ln -s "$SNAKETUNE_BENCH_GGUF" "$d/.realdata/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$d" && SNAKETUNE_GPU_LOCK_DIR=$d/.gpu-locks timeout -k 10 "${LIMIT_S:-420}" python3 -m snakemake \
        "results/train/$e/summary.json" --scheduler greedy --cores 5 --resources gpu=1 --configfile \
        config/examples/smollm2-135m-real.yaml "$R/bench/real_model/configs/real_model.yaml" \
        "$R/bench/convergence/configs/in_backward_real.yaml" >"$OUT/converge_$e.log" 2>&1
     echo "=== $(date -u +%T) $e exit $?") &
    pids+=($!)
done
wait "${pids[@]}"
[[ " $EXPERIMENTS " == *" fp32_adam "* ]] && export REFERENCE=${REFERENCE:-fp32_adam}
python3 bench/convergence/states_rounding.py "$WORK"/wf_*/results/train/*/metrics.csv | tee "$OUT/table.md"
for e in $EXPERIMENTS; do
    for f in metrics.csv summary.json; do cp "$WORK/wf_$e/results/train/$e/$f" "$OUT/${e}.$f" 2>/dev/null; done
done
