#!/usr/bin/env bash
# Run ON THE LENT H200 MACHINE from the repo root, with .whl/ carried (bench/prepare_device_wheels.sh fills it
# here): installs the wheels to /tmp/site, runs the GPU-only tests of the fast path, then
# bench/train_throughput.py, and samples GPU memory once a second the whole time. Everything lands in $OUT:
# throughput.{json,md}, logs.tar.gz, device.log (versions, nvidia-smi, the run's output, memory samples).
#   CASES=seed24,b24,... BUDGET_S=520 [GPU_TESTS=] bash bench/train_throughput.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
source bench/device_env.sh
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,clocks.sm,power.draw --format=csv,noheader -lms 1000 \
  >"$OUT/gpu_samples.csv" 2>&1 &
SMI=$!
GPU_TESTS=${GPU_TESTS-tests/test_kernels.py tests/test_fast_path.py tests/test_adam4bit.py}  # GPU_TESTS= (empty) skips them
if [ -n "$GPU_TESTS" ]; then
  echo "=== [$(date -u +%H:%M:%S)] GPU tests: $GPU_TESTS"
  timeout 120 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS -m gpu -rA 2>&1 | tail -5
fi
echo "=== [$(date -u +%H:%M:%S)] bench/train_throughput.py"
ARGS=(--out "$OUT" --budget-s "${BUDGET_S:-520}")
[ -n "${CASES:-}" ] && ARGS+=(--only "$CASES")
python3 bench/train_throughput.py "${ARGS[@]}"
echo "=== [$(date -u +%H:%M:%S)] exit code $?"
kill "$SMI" 2>/dev/null
gpu_peak "$OUT/gpu_samples.csv"
