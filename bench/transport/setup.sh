# Sourced (not run) by the scripts that run ON THE LENT GPU MACHINE (bench/train_throughput.sh,
# bench/plan_vs_measured.sh), from the repo root: installs the wheels carried in .whl/ (filled here by
# bench/prepare_device_wheels.sh) into /tmp/site, points Python at them and at workflow/, keeps the hub clients
# offline (nothing outside that machine can be reached), and prints what the run will use.
echo "=== [$(date -u +%H:%M:%S)] install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/workflow
export PATH=/tmp/site/bin:$PATH
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
python3 -c 'import torch, deepspeed, transformers, snakemake; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "snakemake", snakemake.__version__)'
git log -1 --format='commit %H %s' 2>/dev/null || true
git status --short 2>/dev/null | head -20 || true

# gpu_peak FILE: the peak of an `nvidia-smi --query-gpu=timestamp,memory.used,... --format=csv,noheader` log.
gpu_peak() {
  python3 - "$1" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    try:
        rows.append((parts[0], int(parts[1].split()[0])))
    except (IndexError, ValueError):
        pass
if rows:
    peak = max(rows, key=lambda r: r[1])
    print(f"nvidia-smi: {len(rows)} samples, peak memory.used {peak[1] / 1024:.1f} GiB at {peak[0]}")
PY
}
