#!/usr/bin/env bash
# config/examples/<name>.yaml as written, through Snakemake, one rank, fewer steps, on the user's formats: a
# hub-format directory of the deepseek-llm-7b architecture written here (write_hub_model.py: random bf16 weights, 3
# safetensors shards, the real tokenizer of SNAKETUNE_BENCH_TOKENIZER) and real oasst rows (SNAKETUNE_BENCH_ROWS),
# both linked into a copy of the workflow in $WORK with configs/examples.yaml. Runs (the arguments; default: lora
# full):
#   lora     deepseek-7b-lora-3x24gb.yaml (SFT, reference, DPO, evaluate, report)
#   full     deepseek-7b-full-h200.yaml
#   fullacc  the full example at micro-batch 4 x 2 (the fp32 accumulation buffer), training only
#   qlora    deepseek-7b-qlora-16gb.yaml
#   qlora24  the QLoRA example under gpu_memory_gib 24 at micro-batch 4 x 2, training only
#   lora4k   the QLoRA example with an unquantized bf16 base under gpu_memory_gib 24, training only (the losses
#            QLoRA's must follow)
# SFT_STEPS (default 20) and DPO_STEPS (10) shorten the runs; BUDGET_S (560) caps them all. Each run's plan,
# summaries, evaluation, report and logs land in $OUT/recipe_<run>.tar.gz, its memory and speed figures in the log.
#   python -m bench recipes [lora] [full] [fullacc] [qlora] [qlora24] [lora4k]
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-recipes}
RUNS=${*:-lora full}
SFT_STEPS=${SFT_STEPS:-20}
DPO_STEPS=${DPO_STEPS:-10}
BUDGET_S=${BUDGET_S:-560}
stamp() { echo "=== [$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
mkdir -p "$W/.realdata"
ln -sfn "$SNAKETUNE_BENCH_ROWS" "$W/.realdata/oasst_real.hf_rows.jsonl"
stamp "hub-format 7B directory"
[ -f "$W/.realdata/deepseek-7b-hub/config.json" ] \
  || python3 bench/recipes/write_hub_model.py "$W/.realdata/deepseek-7b-hub" "$SNAKETUNE_BENCH_TOKENIZER" || exit 1
declare -A EXAMPLE=([lora]=deepseek-7b-lora-3x24gb [full]=deepseek-7b-full-h200 [fullacc]=deepseek-7b-full-h200
  [qlora]=deepseek-7b-qlora-16gb [qlora24]=deepseek-7b-qlora-16gb [lora4k]=deepseek-7b-qlora-16gb)
declare -A EXTRA=([fullacc]="micro_batch_size: 4, " [qlora24]="micro_batch_size: 4, "
  [lora4k]="lora: {enabled: true, rank: 16, alpha: 32, quantize: none}, ")
declare -A TOP=([qlora24]="gpu_memory_gib: 24" [lora4k]="gpu_memory_gib: 24")
declare -A TARGET=([fullacc]="results/train/default/summary.json" [qlora24]="results/train/default/summary.json"
  [lora4k]="results/train/default/summary.json")
for run in $RUNS; do
  [ -n "${EXAMPLE[$run]:-}" ] || { echo "unknown run $run: ${!EXAMPLE[*]}"; exit 2; }
  left=$((BUDGET_S - SECONDS))
  [ "$left" -lt 60 ] && { stamp "skip $run ($left s left)"; continue; }
  stamp "run $run: config/examples/${EXAMPLE[$run]}.yaml ($left s left)"
  (cd "$W" && rm -rf Snakefile workflow config envs results logs benchmarks .snakemake)
  cp -r Snakefile workflow config envs "$W/"
  cat >"$W/steps.yaml" <<YAML
train: {${EXTRA[$run]:-}gpus: 1, max_steps: $SFT_STEPS}
preference: {train: {gpus: 1, max_steps: $DPO_STEPS}}
${TOP[$run]:-}
YAML
  (cd "$W" && timeout -k 10 "$left" python3 -m snakemake ${TARGET[$run]:-} --scheduler greedy --cores "$(nproc)" --resources gpu=1 \
    --show-failed-logs --configfile "config/examples/${EXAMPLE[$run]}.yaml" "$R/bench/recipes/configs/examples.yaml" \
    steps.yaml)
  stamp "run $run exit code $?"
  cd "$W" || exit 1
  grep -h "start check\|device memory budget\|ReferenceMismatch" -r logs/dpo logs/train logs/reference 2>/dev/null | cut -c1-400
  python3 - "$run" <<'PY'
import json, pathlib, sys
run = sys.argv[1]
for p in sorted(pathlib.Path("results").rglob("*.json")):
    if any(k in p.name for k in ("summary", "metrics", "reference")) or "plan" in p.parts:
        if "tokenizer" in str(p) or "model" in p.parts or ("provenance" in p.parts and "plan" in p.parts):
            continue
        d = json.loads(p.read_text())
        keep = {k: d.get(k) for k in ("peak_memory_gib_per_rank", "device_memory_per_rank", "tokens_per_s_per_gpu",
                "step_time_s", "mfu", "final_train_loss", "final_val_loss", "memory", "peak_memory_gib",
                "predicted_peak_gib", "fp32_master_weights", "final_val_reward_accuracy", "start_check", "logprobs",
                "kernels", "attention", "time_s", "wall_time_s") if k in d}
        if "plan" in p.parts and "provenance" not in p.parts:
            keep = {"chosen": d.get("chosen", {}).get("estimate", {}).get("peak_allocated_gib"),
                    "evaluate": d.get("evaluate"), "dpo": (d.get("dpo") or {}).get("chosen", {}).get("estimate", {}).get("peak_allocated_gib"),
                    "status": d.get("status")}
        print(run, p, json.dumps(keep))
PY
  tar czf "$OUT/recipe_$run.tar.gz" results/plan results/train/*/summary.json results/train/*/metrics.csv \
    results/eval results/dpo/*/summary.json results/dpo/*/metrics.csv results/preference results/report/report.md \
    results/report/summary.json results/data/preferences/*/stats.json results/tokenized*/*/stats.json logs benchmarks 2>/dev/null
  rm -rf results/train/*/model results/dpo/*/model results/checkpoints
  cd "$R" || exit 1
done
