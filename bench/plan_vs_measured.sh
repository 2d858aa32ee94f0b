#!/usr/bin/env bash
# Run ON THE LENT H200 MACHINE, from the repo root, with .whl/ carried (bench/prepare_device_wheels.sh fills it
# here): installs the carried wheels to /tmp/site (as bench/device_train.sh does), then runs
# bench/plan_vs_measured.py, which prints predicted vs measured peak memory as it goes and writes
# plan_vs_measured.{md,json} and its whole output (plan_vs_measured.log) to $OUT. BUDGET_S caps the
# script's own time (default 530 s, inside the tool's 600 s command limit); ONLY=case,case picks cases.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/plan_vs_measured.log") 2>&1
source bench/device_env.sh
ARGS=(--budget-s "${BUDGET_S:-530}" --out "$OUT")
[ -n "${ONLY:-}" ] && ARGS+=(--only "$ONLY")
python3 bench/plan_vs_measured.py "${ARGS[@]}"
echo "=== [$(date -u +%H:%M:%S)] exit code $?"
