#!/usr/bin/env bash
# The deepseek-llm-7b architecture (random init) through the workflow as a user runs it, on one GPU of 141 GB:
#   zero2  configs/h200_7b_zero2.yaml: 24 of 30 layers, full fine-tuning, ZeRO-2, bf16, micro-batch 4 x 2
#   lora   configs/h200_7b_lora.yaml: all 30 layers, LoRA r16 on every linear layer, ZeRO-2, micro-batch 8 x 1
# Snakemake runs in a copy of the workflow in $WORK (default /tmp/snaketune-workflow-7b), builtin data. The train
# rule builds an arch:* model on the GPU; each run's summary.json, metrics.csv and train log land in $OUT, the
# benchmark file of each rule in the log. BUDGET_S caps the whole (default 560 s).
#   python -m bench workflow_7b [zero2] [lora]            (both by default)
set -uo pipefail
OUT=${OUT:-/tmp/out}
W=${WORK:-/tmp/snaketune-workflow-7b}
BUDGET_S=${BUDGET_S:-560}
RUNS=${*:-zero2 lora}
R=$PWD
stamp() { echo "=== [$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
rm -rf "$W" && mkdir -p "$W" && cp -r Snakefile workflow config envs "$W/"

collect() {  # experiment, prefix
  local exp=$1 p=$2
  cp "$W/results/train/$exp/summary.json" "$OUT/${p}_summary.json" 2>/dev/null || true
  cp "$W/results/train/$exp/metrics.csv" "$OUT/${p}_metrics.csv" 2>/dev/null || true
  cp "$W/logs/train/$exp.log" "$OUT/${p}_train.log" 2>/dev/null || true
  for f in "$W"/benchmarks/*.tsv "$W"/benchmarks/*/*.tsv; do [ -f "$f" ] && echo "--- ${f#$W/}: $(tail -1 "$f")"; done
  echo "--- DeepSpeed op builds / JIT in logs/train/$exp.log"
  grep -nE "Building extension|Loading extension|Time to load|ninja|JIT" "$W/logs/train/$exp.log" 2>/dev/null | head -20
  echo "--- $OUT/${p}_summary.json"; cat "$OUT/${p}_summary.json" 2>/dev/null || true
}

RC=0
for run in $RUNS; do
  case $run in
    zero2) CONFIG=$R/bench/throughput/configs/h200_7b_zero2.yaml EXP=default TARGET= ;;
    lora) CONFIG=$R/bench/throughput/configs/h200_7b_lora.yaml EXP=lora30 TARGET=results/train/lora30/summary.json ;;
    *) echo "unknown run $run: zero2 or lora"; exit 2 ;;
  esac
  LEFT=$((BUDGET_S - SECONDS))
  [ "$LEFT" -gt 120 ] || { stamp "$run skipped ($LEFT s left)"; continue; }
  stamp "$run ($LEFT s left)"
  # The target goes before --configfile, which takes every word after it as a config file.
  (cd "$W" && timeout -k 15 "$LEFT" python3 -m snakemake $TARGET --scheduler greedy --cores "$(nproc)" --resources gpu=1 \
    --configfile "$CONFIG" --show-failed-logs)
  rc=$?
  stamp "$run exit code $rc"
  [ "$rc" -eq 0 ] || RC=$rc
  collect "$EXP" "$run"
  rm -rf "$W/results/train/$EXP/model"  # 11-14 GB of weights: free the disk for the next run
done
exit $RC
