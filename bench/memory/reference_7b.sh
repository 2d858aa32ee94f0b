#!/usr/bin/env bash
# Issue #46: the reference pass of a full-weight DPO of the 7B (30 layers, arch:deepseek-llm-7b, bf16, ZeRO-0),
# its device memory (NVML, the reference.json the stage writes) with the workflow as it is and, where
# .carry/old/workflow.tar.gz holds an earlier workflow (git archive <commit> Snakefile workflow config envs), with
# that one, in the same call: the pass once built the training engine, fp32 master weights and all.
#   python -m bench reference_memory        (SNAKETUNE_BENCH_TOKENIZER: the real DeepSeek tokenizer)
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
CONFIG=$R/bench/memory/configs/reference_7b.yaml
run() {  # name, workflow directory
    local name=$1 w=$2
    printf 'model: {tokenizer: %s}\n' "$SNAKETUNE_BENCH_TOKENIZER" >"$w/tokenizer.yaml"
    echo "=== $(date -u +%T) $name: the reference pass"
    (cd "$w" && timeout -k 10 480 python3 -m snakemake --until reference --scheduler greedy --cores "$(nproc)" \
        --resources gpu=1 --configfile "$CONFIG" tokenizer.yaml >"$OUT/$name.log" 2>&1)
    echo "=== $(date -u +%T) $name exit $?"
    python3 - "$w" "$name" <<'PY'
import json, pathlib, sys
w, name = pathlib.Path(sys.argv[1]), sys.argv[2]
for rec in sorted(w.glob("results/preference/*/reference-*/reference.json")):
    r = json.loads(rec.read_text())
    dev = (r.get("device_memory_per_rank") or [{}])[0] or {}
    print(f"{name}: allocator peak {r.get('peak_memory_gib_per_rank')} GiB; device {json.dumps(dev)}; "
          f"{r.get('time_s')} s")
PY
    tail -n 30 "$w"/logs/reference/*.log >"$OUT/$name.reference.log" 2>/dev/null
}
for name in now old; do
    w=/tmp/snaketune-refmem-$name
    rm -rf "$w" && mkdir -p "$w"
    if [ $name = now ]; then cp -r Snakefile workflow config envs "$w/"
    elif [ -f .carry/old/workflow.tar.gz ]; then tar xzf .carry/old/workflow.tar.gz -C "$w"
    else echo "no .carry/old/workflow.tar.gz: the earlier workflow is not compared"; continue; fi
    run $name "$w"
done
