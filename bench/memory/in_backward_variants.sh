#!/usr/bin/env bash
# The step in backward's device memory (throughput case full30_inbwd: the 7B, 30 layers, 1 x 2,048 tokens, 4-bit
# states) under variants, one run each: `default` (as the code is: the rank sets the allocator's expandable segments
# itself since 2026-12-03), `noexpandable` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False: PyTorch's default
# allocator, as before), `expandable` (=True, set from outside), and each of these with `chunk24_` in front (the
# update's row chunks halved to 2^24 elements). A chunk variant edits CHUNK_ELEMENTS in this
# checkout's workflow/snaketune/train/backward_step.py for its run and restores the file when the script ends (if the
# script is killed, `git checkout workflow/snaketune/train/backward_step.py`). Each variant's throughput files land
# in $OUT/<variant>/, and a line of its figures (tokens/s, allocated and device peaks, the plan's) in the log.
#   python -m bench in_backward_memory [default] [noexpandable] [expandable] [chunk24_noexpandable] ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
W=${WORK:-/tmp/snaketune-memory}
BS=workflow/snaketune/train/backward_step.py
ORIG=$(mktemp)
cp "$BS" "$ORIG"
trap 'cp "$ORIG" "$BS"; rm -f "$ORIG"' EXIT INT TERM
for v in ${*:-default noexpandable chunk24_noexpandable}; do
    cp "$ORIG" "$BS"
    case $v in *chunk24*) sed -i 's/^CHUNK_ELEMENTS = 2\*\*25$/CHUNK_ELEMENTS = 2**24/' "$BS" ;; esac
    grep -n '^CHUNK_ELEMENTS' "$BS"
    alloc=; case $v in *noexpandable) alloc=expandable_segments:False ;; *expandable) alloc=expandable_segments:True ;; esac
    rm -rf "$W/results/train/full30_inbwd" "$W/results/checkpoints/full30_inbwd" "$W/results/plan/full30_inbwd.json"
    echo "=== $(date -u +%T) variant $v (PYTORCH_CUDA_ALLOC_CONF=$alloc)"
    env ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc} python3 bench/throughput/train_throughput.py --out "$OUT/$v" \
        --work "$W" --budget-s "${BUDGET_S:-150}" --only full30_inbwd --no-peer
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"][0]; print(sys.argv[2], {k: r.get(k) for k in ("status", "real_per_s", "peak_gib", "device_peak_gib", "plan_peak_gib")})' \
        "$OUT/$v/throughput.json" "$v"
done
