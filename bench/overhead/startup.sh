# Where the ~20 s of fixed cost per GPU stage go on the lent H200 (issue #24: the 135M model's stages are short, so
# process start-up decides their wall time). Carry .whl2, .rm/smol (SmolLM2-135M's config and tokenizer files) and
# .rm/c1 (the oasst rows as xz): import times of the modules a rank loads, then the train stage on the SmolLM2
# architecture (random weights, 4 steps) with PYTHONPROFILEIMPORTTIME=1 in its rank (import times in its log).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; exec > >(tee -a "$OUT/device.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
for m in "import torch" "import torch; torch.cuda.init()" "import transformers" "import datasets" "import deepspeed" \
         "import liger_kernel.transformers" "import snaketune.train.trainer"; do
    for i in 1 2; do
        s=$(date +%s.%N); python3 -c "$m" > /dev/null 2>&1; e=$(date +%s.%N)
        echo "$(python3 -c "print(f'{$e - $s:6.2f} s')")  $m (run $i)"
    done
done
python3 -X importtime -c "import snaketune.train.trainer" 2> "$OUT/importtime_trainer.txt"
sort -t'|' -k2 -n -r "$OUT/importtime_trainer.txt" | head -25
mkdir -p .realdata && python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(".rm/c1/oasst_real.hf_rows.jsonl.xz"), open(".realdata/oasst_real.hf_rows.jsonl", "wb"))'
python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(".rm/smol")
m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
m.save_pretrained("/tmp/smol-rand")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".rm/smol/{f}", f"/tmp/smol-rand/{f}")
PY
cat > /tmp/prof.yaml <<'Y'
dataset: {source: .realdata/oasst_real.hf_rows.jsonl}
model: {base: /tmp/smol-rand}
export: {enabled: false}
preference: {enabled: false}
train: {epochs: null, max_steps: 4, log_every: 1}
Y
PYTHONPROFILEIMPORTTIME=1 timeout 300 python3 -m snakemake results/train/default/summary.json --scheduler greedy --cores 16 \
    --resources gpu=1 --configfile config/examples/smollm2-135m-real.yaml /tmp/prof.yaml > "$OUT/snakemake.log" 2>&1
echo "snakemake exit $?"
cp logs/train/default.log "$OUT/train.log"; cp benchmarks/train/default.tsv "$OUT/train_benchmark.tsv"
grep -v "import time" logs/train/default.log | cut -c1-200 | head -30
grep "import time" logs/train/default.log | sort -t'|' -k2 -n -r | head -30
