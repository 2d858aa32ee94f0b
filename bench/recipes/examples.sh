#!/usr/bin/env bash
# Run ON THE LENT H200 MACHINE from the repo root, with .whl/ (bench/prepare_device_wheels.sh) and .realdata/
# (the real tokenizer and oasst rows, copied from ../shared/realdata) carried. Writes a hub-format 7B directory,
# then runs config/examples/<name>.yaml through Snakemake as written, with bench/configs/device_realpath.yaml
# (model and data paths) and the steps given here, one rank:
#   RUNS="lora full" SFT_STEPS=20 DPO_STEPS=10 bash bench/device_realpath.sh
#   RUNS="qlora lora4k" SFT_STEPS=12 bash bench/device_realpath.sh
# Everything lands in $OUT: device.log and realpath_<run>.tar.gz (plan, summaries, eval metrics, logs).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
source bench/device_env.sh
RUNS=${RUNS:-lora full}
SFT_STEPS=${SFT_STEPS:-20}
DPO_STEPS=${DPO_STEPS:-10}
BUDGET_S=${BUDGET_S:-560}
stamp() { echo "=== [$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 1000 >"$OUT/gpu_samples.csv" 2>&1 &
SMI=$!
if [ -n "${GPU_TESTS:-}" ]; then
  stamp "GPU tests: $GPU_TESTS"
  timeout 120 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS -m gpu -rA 2>&1 | tail -8
fi
stamp "hub-format 7B directory"
python3 bench/write_hub_model.py /tmp/deepseek-7b-hub .realdata || exit 1
ls -la /tmp/deepseek-7b-hub
declare -A EXAMPLE=([lora]=deepseek-7b-lora-3x24gb [full]=deepseek-7b-full-h200 [fullacc]=deepseek-7b-full-h200
  [qlora]=deepseek-7b-qlora-16gb [qlora24]=deepseek-7b-qlora-16gb [lora4k]=deepseek-7b-qlora-16gb)
# fullacc: the one-H200 example at micro-batch 4 x 2 accumulation (the fp32 accumulation buffer), training only.
# qlora24: the QLoRA example under gpu_memory_gib 24 at micro-batch 4 x 2, training only. lora4k: the QLoRA
# example with an unquantized bf16 base under gpu_memory_gib 24, training only (the losses QLoRA's must follow).
declare -A EXTRA=([fullacc]="micro_batch_size: 4, " [qlora24]="micro_batch_size: 4, "
  [lora4k]="lora: {enabled: true, rank: 16, alpha: 32, quantize: none}, ")
declare -A TOP=([qlora24]="gpu_memory_gib: 24" [lora4k]="gpu_memory_gib: 24")
declare -A TARGET=([fullacc]="results/train/default/summary.json" [qlora24]="results/train/default/summary.json"
  [lora4k]="results/train/default/summary.json")
for run in $RUNS; do
  left=$((BUDGET_S - SECONDS))
  [ "$left" -lt 60 ] && { stamp "skip $run ($left s left)"; continue; }
  stamp "run $run: config/examples/${EXAMPLE[$run]}.yaml ($left s left)"
  cat > /tmp/steps.yaml <<YAML
train: {${EXTRA[$run]:-}gpus: 1, max_steps: $SFT_STEPS}
preference: {train: {gpus: 1, max_steps: $DPO_STEPS}}
${TOP[$run]:-}
YAML
  rm -rf results logs benchmarks .snakemake
  timeout -k 10 "$left" python3 -m snakemake ${TARGET[$run]:-} --cores 16 --resources gpu=1 --show-failed-logs \
    --configfile "config/examples/${EXAMPLE[$run]}.yaml" bench/configs/device_realpath.yaml /tmp/steps.yaml
  stamp "run $run exit code $?"
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
  tar czf "$OUT/realpath_$run.tar.gz" results/plan results/train/*/summary.json results/train/*/metrics.csv \
    results/eval results/dpo/*/summary.json results/dpo/*/metrics.csv results/preference results/report/report.md \
    results/report/summary.json results/data/preferences/*/stats.json results/tokenized*/*/stats.json logs benchmarks 2>/dev/null
  rm -rf results/train/*/model results/dpo/*/model results/checkpoints
done
kill $SMI 2>/dev/null
gpu_peak "$OUT/gpu_samples.csv"
stamp done
