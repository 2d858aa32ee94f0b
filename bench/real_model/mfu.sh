# Run ON THE LENT H200 from the repo root with .whl2/ (bench/prepare_device_wheels.sh's wheels less pulp and
# bitsandbytes) and .rm/ (the imported SmolLM2 config.json and tokenizer files in .rm/smol, the real oasst rows)
# carried: the train stage on the SmolLM2-135M architecture (random bf16 weights) at micro-batches 8/32/64 and with
# torch.compile (issue #24, MFU of the 135M step).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; exec > >(tee -a $OUT/device.log) 2>&1
echo "=== $(date -u +%T) install"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
git log -1 --format='commit %H %s'
python3 -c 'import torch, transformers, deepspeed, liger_kernel; print(torch.__version__, transformers.__version__, deepspeed.__version__)'
echo "=== $(date -u +%T) random-weight SmolLM2-135M architecture"
python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(".rm/smol")
torch.manual_seed(0)
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
m.save_pretrained("/tmp/smol-rand")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".rm/smol/{f}", f"/tmp/smol-rand/{f}")
print("parameters", sum(p.numel() for p in m.parameters()))
PY
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 > $OUT/gpu_samples.csv 2>&1 &
echo "=== $(date -u +%T) snakemake"
T=""; for e in mb8 mb32 mb64 mb32c; do T="$T results/train/$e/summary.json"; done
timeout -k 10 470 python3 -m snakemake $T --scheduler greedy --cores 16 --resources gpu=1 --show-failed-logs \
  --configfile config/examples/smollm2-135m-real.yaml bench/configs/smollm2_mfu.yaml
echo "=== $(date -u +%T) exit $?"
python3 - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("results/train").glob("*/summary.json")):
    d = json.loads(p.read_text())
    keep = {k: d.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib_per_rank", "device_memory_per_rank",
                                   "micro_batch_size", "global_batch_size", "steps", "final_train_loss", "attention", "kernels", "loss_kernel", "compile")}
    print(p.parent.name, json.dumps(keep))
PY
grep -h "tok/s\|MFU\|device memory\|attention\|compile" logs/train/*.log | cut -c1-300 | tail -40
tar czf $OUT/mfu_logs.tar.gz logs results/train/*/summary.json results/train/*/metrics.csv results/plan 2>/dev/null
