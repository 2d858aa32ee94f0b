#!/usr/bin/env bash
# Issue #24, the 135M step: the train stage of config/examples/smollm2-135m-real.yaml + configs/smollm2_mfu.yaml on
# the SmolLM2-135M architecture with random bf16 weights (random_smol.py; a step's speed does not depend on the
# weights' values) and real oasst rows (SNAKETUNE_BENCH_ROWS), at micro-batches 8, 32, 64 and 32 with torch.compile,
# through Snakemake in a copy of the workflow in $WORK. Each run's figures (tokens/s, MFU, memory) in the log; the
# summaries, metrics and logs in $OUT/mfu_logs.tar.gz.
#   python -m bench smollm2_mfu [mb8 mb32 mb64 mb32c]
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-smollm2-mfu}
rm -rf "$W" && mkdir -p "$W/.realdata" && cp -r Snakefile workflow config envs "$W/"
ln -s "$SNAKETUNE_BENCH_ROWS" "$W/.realdata/oasst_real.hf_rows.jsonl"
python3 bench/real_model/random_smol.py "$W/.realdata/smol-rand" || exit 1
T=(); for e in ${*:-mb8 mb32 mb64 mb32c}; do T+=("results/train/$e/summary.json"); done
echo "=== $(date -u +%T) snakemake"
(cd "$W" && timeout -k 10 "${LIMIT_S:-470}" python3 -m snakemake "${T[@]}" --scheduler greedy --cores "$(nproc)" \
    --resources gpu=1 --show-failed-logs --configfile config/examples/smollm2-135m-real.yaml \
    "$R/bench/real_model/configs/smollm2_mfu.yaml")
rc=$?
echo "=== $(date -u +%T) exit $rc"
cd "$W" || exit 1
python3 - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("results/train").glob("*/summary.json")):
    d = json.loads(p.read_text())
    keep = {k: d.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib_per_rank", "device_memory_per_rank",
                                   "micro_batch_size", "global_batch_size", "steps", "final_train_loss", "attention",
                                   "kernels", "loss_kernel", "compile")}
    print(p.parent.name, json.dumps(keep))
PY
grep -h "tok/s\|MFU\|device memory\|attention\|compile" logs/train/*.log | cut -c1-300 | tail -40
tar czf "$OUT/mfu_logs.tar.gz" logs results/train/*/summary.json results/train/*/metrics.csv results/plan 2>/dev/null
exit $rc
