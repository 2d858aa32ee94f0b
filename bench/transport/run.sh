#!/usr/bin/env bash
# Run a case of `python -m bench` ON A GPU MACHINE WITHOUT NETWORK, from the repository root, with the carried
# folders (bench/README.md, "A GPU machine without network"): bench/transport/setup.sh installs and unpacks them,
# then the case runs as on any machine. Its files go to $OUT/CASE ($OUT: /tmp/out unless set).
#
#   bash bench/transport/run.sh CASE [ARGS ...]          e.g. bash bench/transport/run.sh throughput --only b24_liger
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/transport/run.sh CASE [ARGS ...] (python3 -m bench --list)"; exit 2; }
export OUT=${OUT:-/tmp/out}/$1
mkdir -p "$OUT"
source bench/transport/setup.sh >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -n 20 "$OUT/setup.log"
exec python3 -m bench "$@"
