#!/usr/bin/env bash
# A throughput case under SNAKETUNE_PROFILE (snaketune.train.profiling): a torch.profiler trace of steps 4-6 of the
# rank, its GPU kernels by time, how busy the GPU was, the host's operators. The run's tokens/s are not a figure
# (those steps run under the profiler). Writes $OUT/profile/ (top_rank0.md and the trace) and the throughput files.
#   python -m bench profile [--only full30_inbwd] [--budget-s 200]
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/snaketune-profile}
ARGS=("$@")
[[ " $* " == *" --only "* ]] || ARGS+=(--only full30_inbwd)
[[ " $* " == *" --budget-s "* ]] || ARGS+=(--budget-s 200)
rm -rf "$WORK" "$OUT/profile"
SNAKETUNE_PROFILE=$OUT/profile python3 bench/throughput/train_throughput.py --out "$OUT" --work "$WORK" --no-peer "${ARGS[@]}"
rc=$?
cat "$OUT"/profile/top_rank0.md 2>/dev/null
exit $rc
