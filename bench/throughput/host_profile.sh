#!/usr/bin/env bash
# Where a training rank's host time goes when the GPU waits on it: a throughput case under py-spy (native frames,
# every thread of every process, $RATE samples/s, default 50), its collapsed stacks in $OUT/spy_raw.txt.gz, then
# spy_summary.py's reading of them (the rank's threads, their inclusive and innermost frames). Sampling slows the
# step: read shares, not times. Needs py-spy (`pip install py-spy`; transport: its wheel in a .carry folder).
#   python -m bench host_profile [--only full30_inbwd] [--budget-s 200]
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/snaketune-spy}
command -v py-spy >/dev/null || { echo "py-spy is not installed (pip install py-spy)"; exit 2; }
ARGS=("$@")
[[ " $* " == *" --only "* ]] || ARGS+=(--only full30_inbwd)
[[ " $* " == *" --budget-s "* ]] || ARGS+=(--budget-s 200)
rm -rf "$WORK"
py-spy record --native --subprocesses --threads -r "${RATE:-50}" -f raw -o "$WORK.spy_raw.txt" -- \
    python3 bench/throughput/train_throughput.py --out "$OUT/spy" --work "$WORK" --no-peer "${ARGS[@]}"
rc=$?
gzip -c "$WORK.spy_raw.txt" >"$OUT/spy_raw.txt.gz" && python3 bench/throughput/spy_summary.py "$OUT/spy_raw.txt.gz"
exit $rc
