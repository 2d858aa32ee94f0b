#!/usr/bin/env bash
# Issue #24's wall time per stage: the SFT and DPO stages of config/examples/smollm2-135m-real.yaml through the
# workflow (Snakemake's benchmark files), then TRL's padded mode (real_model_trl.py, the peer) on the same run's
# tokens, pairs and schedule, in the same call. The SmolLM2-135M architecture with random weights (random_smol.py: a
# stage's wall time does not depend on the weights' values: fixed steps, no generation), real oasst rows
# (SNAKETUNE_BENCH_ROWS), in a copy of the workflow in $WORK. Also checks that the launcher's GPU count, names,
# memory and peer access from the CUDA driver (snaketune.cuda_driver) are torch's, and times both.
#   python -m bench stage_times
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-stage-times}
EXAMPLE=config/examples/smollm2-135m-real.yaml

echo "=== the launcher's GPU facts: CUDA driver against torch"
for i in 1 2; do
    s=$(date +%s.%N); python3 -c 'from snaketune import gpus; n = gpus.cuda_device_count(); print(n, gpus.cuda_devices(range(n)))'
    e=$(date +%s.%N); echo "  driver: $(python3 -c "print(f'{$e - $s:.2f} s')")"
    s=$(date +%s.%N); python3 -c 'import torch; n = torch.cuda.device_count(); print(n, [(p.name, p.total_memory / 2**30) for p in map(torch.cuda.get_device_properties, range(n))])'
    e=$(date +%s.%N); echo "  torch:  $(python3 -c "print(f'{$e - $s:.2f} s')")"
done

rm -rf "$W" && mkdir -p "$W/.realdata" "$W/results/models" && cp -r Snakefile workflow config envs "$W/"
ln -s "$SNAKETUNE_BENCH_ROWS" "$W/.realdata/oasst_real.hf_rows.jsonl"
python3 bench/real_model/random_smol.py "$W/.realdata/smol-rand" || exit 1
printf 'model: {base: .realdata/smol-rand}\n' >"$W/stage_times.yaml"
echo "=== $(date -u +%T) workflow: SFT and DPO stages of the example"
(cd "$W" && timeout -k 10 420 python3 -m snakemake results/dpo/default/summary.json --scheduler greedy \
    --cores "$(nproc)" --resources gpu=1 --configfile "$EXAMPLE" "$R/bench/real_model/configs/real_model.yaml" \
    stage_times.yaml >"$OUT/workflow.log" 2>&1)
echo "=== $(date -u +%T) workflow exit $?"
cd "$W" || exit 1
for f in $(find benchmarks -name '*.tsv' | sort); do echo "  $f $(tail -1 "$f" | cut -f1) s"; done
grep -h "GPUs assigned\|launching\|first\|done:" logs/train/default.log logs/reference/default-*.log logs/dpo/default.log | cut -c1-160
# real_model_trl.py reads the base model where rule import_gguf would have left it
ln -sfn "$W/.realdata/smol-rand" results/models/smol-rand
echo "=== $(date -u +%T) TRL padded (SFT, DPO)"
python3 "$R/bench/real_model/real_model_trl.py" --run . --config "$EXAMPLE" "$R/bench/real_model/configs/real_model.yaml" \
    stage_times.yaml --out "$W/trl_padded" --mode padded --stages sft,dpo >"$OUT/trl_padded.log" 2>&1
echo "=== $(date -u +%T) TRL exit $?"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print({k: round(r[k]["wall_s"], 1) for k in ("sft", "dpo") if k in r}, "imports", round(r["import_s"], 1))' "$W/trl_padded/trl.json"
tar czf "$OUT/stage_times.tar.gz" benchmarks logs results/train/default/summary.json results/dpo/default/summary.json \
    trl_padded/trl.json 2>/dev/null
