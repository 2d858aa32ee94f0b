#!/usr/bin/env bash
# Where the ~20 s of fixed cost per GPU stage go (issue #24: the 135M model's stages are short, so process start-up
# decides their wall time): wall time of importing each module a rank loads, in fresh processes, twice each; the
# trainer's import profile ($OUT/importtime_trainer.txt); then the train stage on the SmolLM2 architecture (random
# weights: bench/real_model/random_smol.py; real oasst rows, SNAKETUNE_BENCH_ROWS; 4 steps) with
# PYTHONPROFILEIMPORTTIME=1 in its rank, in a copy of the workflow in $WORK: its log and benchmark file in $OUT.
#   python -m bench startup
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-startup}
for m in "import torch" "import torch; torch.cuda.init()" "import transformers" "import datasets" "import deepspeed" \
         "import liger_kernel.transformers" "import snaketune.train.trainer"; do
    for i in 1 2; do
        s=$(date +%s.%N); python3 -c "$m" >/dev/null 2>&1; e=$(date +%s.%N)
        echo "$(python3 -c "print(f'{$e - $s:6.2f} s')")  $m (run $i)"
    done
done
python3 -X importtime -c "import snaketune.train.trainer" 2>"$OUT/importtime_trainer.txt"
sort -t'|' -k2 -n -r "$OUT/importtime_trainer.txt" | head -25
rm -rf "$W" && mkdir -p "$W/.realdata" && cp -r Snakefile workflow config envs "$W/"
ln -s "$SNAKETUNE_BENCH_ROWS" "$W/.realdata/oasst_real.hf_rows.jsonl"
python3 bench/real_model/random_smol.py "$W/.realdata/smol-rand" || exit 1
cat >"$W/startup.yaml" <<'Y'
dataset: {source: .realdata/oasst_real.hf_rows.jsonl}
model: {base: .realdata/smol-rand}
export: {enabled: false}
preference: {enabled: false}
train: {epochs: null, max_steps: 4, log_every: 1}
Y
(cd "$W" && PYTHONPROFILEIMPORTTIME=1 timeout 300 python3 -m snakemake results/train/default/summary.json \
    --scheduler greedy --cores "$(nproc)" --resources gpu=1 --configfile config/examples/smollm2-135m-real.yaml \
    startup.yaml >"$OUT/snakemake.log" 2>&1)
echo "snakemake exit $?"
cp "$W/logs/train/default.log" "$OUT/train.log"; cp "$W/benchmarks/train/default.tsv" "$OUT/train_benchmark.tsv"
grep -v "import time" "$W/logs/train/default.log" | cut -c1-200 | head -30
grep "import time" "$W/logs/train/default.log" | sort -t'|' -k2 -n -r | head -30
