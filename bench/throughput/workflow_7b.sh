#!/usr/bin/env bash
# Run ON THE LENT H200 MACHINE, from the repo root, with .whl/ carried (bench/prepare_device_wheels.sh fills
# it here). Installs the carried wheels to /tmp/site, then runs the real workflow (data stages on CPU, the
# train rule on the GPU):
#
#   1. python3 -m snakemake --cores 16 --resources gpu=1 --configfile bench/configs/h200_7b_zero2.yaml
#      (deepseek-llm-7b architecture cut to 24 layers, full fine-tuning, ZeRO-2, bf16)
#   2. if time is left: the 30-layer LoRA variant (bench/configs/h200_7b_lora.yaml, experiment lora30)
#
# RUNS="zero2 lora" (default) picks the runs; RUNS=lora runs only the LoRA variant (its own call: the
# train rule builds the random-init model on one CPU core, ~3.5 min for 24 layers, ~4.5 min for 30, so
# both do not fit in one 600 s command). BUDGET_S caps the command's own time.
#
# Everything worth keeping lands in $OUT (at most 8 files come back): device.log (versions, nvidia-smi,
# both snakemake runs, GPU memory samples), and per run summary.json, metrics.csv and the train rule's log.
# Results: bench/RESULTS.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-560}   # leave time for $OUT to come back inside the 600 s command limit
RUNS=${RUNS:-zero2 lora}
mkdir -p "$OUT"
LOG=$OUT/device.log
exec > >(tee -a "$LOG") 2>&1
stamp() { echo "=== [$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

stamp "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH
# Nothing outside the machine can be reached: never let the hub clients wait on the network.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1

stamp "versions"
uname -a
nvidia-smi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "capability", torch.cuda.get_device_capability(0))
for m in ("deepspeed", "transformers", "tokenizers", "datasets", "snakemake", "peft", "accelerate",
          "safetensors", "huggingface_hub", "pandas", "pyarrow", "numpy", "fsspec", "pydantic", "pulp",
          "tensorboard", "triton"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')} {getattr(mod, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"{m} IMPORT FAILED: {type(e).__name__}: {e}")
EOF
python3 -m snakemake --version || { echo "snakemake is not runnable"; exit 1; }
git log -1 --format='commit %H %s' 2>/dev/null || true
git status --short 2>/dev/null | head -30 || true

# GPU memory and load, one sample a second, for the whole session (the summary's peak is the PyTorch
# allocator's max_memory_allocated; this adds what the allocator reserved and the CUDA context).
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,clocks.sm,power.draw --format=csv,noheader -lms 1000 \
  >/tmp/gpu_samples.csv 2>&1 &
SMI_PID=$!

collect() {  # experiment, prefix
  local exp=$1 p=$2
  cp "results/train/$exp/summary.json" "$OUT/${p}_summary.json" 2>/dev/null \
    || cp "results/checkpoints/$exp"/*/summary.json "$OUT/${p}_summary.json" 2>/dev/null || true
  cp "results/train/$exp/metrics.csv" "$OUT/${p}_metrics.csv" 2>/dev/null \
    || cp "results/checkpoints/$exp"/*/metrics.csv "$OUT/${p}_metrics.csv" 2>/dev/null || true
  cp "logs/train/$exp.log" "$OUT/${p}_train.log" 2>/dev/null || true
  echo "--- benchmarks/train/$exp.tsv"; cat "benchmarks/train/$exp.tsv" 2>/dev/null || true
  echo "--- DeepSpeed op builds / JIT in logs/train/$exp.log"
  grep -nE "Building extension|Loading extension|Time to load|ninja|JIT|ds_accelerator|accelerator to" \
    "logs/train/$exp.log" 2>/dev/null | head -20 || true
  echo "--- $OUT/${p}_summary.json"; cat "$OUT/${p}_summary.json" 2>/dev/null || true
  echo
}

RC1=0
if [[ " $RUNS " == *" zero2 "* ]]; then
stamp "run 1: 24-layer full fine-tuning, ZeRO-2, bf16"
CMD1=(python3 -m snakemake --cores 16 --resources gpu=1 --configfile bench/configs/h200_7b_zero2.yaml --show-failed-logs)
echo "+ ${CMD1[*]}"
timeout -k 15 $((BUDGET_S - SECONDS)) "${CMD1[@]}"
RC1=$?
stamp "run 1 exit code $RC1"
collect default zero2
# The 11 GB model directory is not needed here; free the disk for the second run.
rm -rf results/train/default/model
fi

LEFT=$((BUDGET_S - SECONDS))
if [[ " $RUNS " == *" lora "* ]] && [ "$RC1" -eq 0 ] && [ "$LEFT" -gt 200 ]; then
  stamp "run 2: 30-layer LoRA r16, ZeRO-2, bf16 ($LEFT s left)"
  # The target goes before --configfile, which takes every word after it as a config file.
  CMD2=(python3 -m snakemake results/train/lora30/summary.json --cores 16 --resources gpu=1
    --configfile bench/configs/h200_7b_lora.yaml --show-failed-logs)
  echo "+ ${CMD2[*]}"
  timeout -k 15 $((BUDGET_S - SECONDS)) "${CMD2[@]}"
  RC2=$?
  stamp "run 2 exit code $RC2"
  collect lora30 lora
else
  stamp "run 2 skipped (run 1 exit code $RC1, $LEFT s left)"
fi

kill "$SMI_PID" 2>/dev/null
stamp "GPU samples: peak memory.used and the samples at the top of it"
python3 - <<'EOF'
rows = []
for line in open("/tmp/gpu_samples.csv"):
    parts = [p.strip() for p in line.split(",")]
    try:
        rows.append((parts[0], int(parts[1].split()[0]), parts[2], parts[3], parts[4]))
    except (IndexError, ValueError):
        pass
if rows:
    peak = max(rows, key=lambda r: r[1])
    print(f"{len(rows)} samples; peak memory.used {peak[1]} MiB = {peak[1] / 1024:.1f} GiB at {peak[0]}")
    busy = [r for r in rows if r[2] not in ("0 %",)]
    print("samples with GPU load > 0:", len(busy))
    for r in rows[:: max(1, len(rows) // 60)]:
        print(", ".join(map(str, r)))
EOF
stamp "done"
