# Issue #24's wall time per stage on the lent H200, after the start-up work: the SFT and DPO stages of
# config/examples/smollm2-135m-real.yaml through the workflow, then TRL's padded mode (bench/real_model_trl.py) on the
# same run's tokens, pairs and schedule. The SmolLM2-135M architecture with random weights (its config and tokenizer
# from .rm/smol): a stage's wall time does not depend on the weights' values (fixed steps, no generation), so the
# 98 MB GGUF file need not travel. Also checks that the rule process's GPU count, names, memory and peer access from
# the CUDA driver (snaketune.cuda_driver) are torch's, and times both. Carry .whl2, .rm/smol and .rm/c1; from the
# repo root:   bash bench/device_stage_times.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; exec > >(tee -a "$OUT/device.log") 2>&1
R=$PWD
EXAMPLE=config/examples/smollm2-135m-real.yaml
echo "=== $(date -u +%T) $(git log -1 --format='commit %H %s' 2>/dev/null)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl2/*.whl .rm/c1/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$R/workflow PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv

echo "=== the launcher's GPU facts: CUDA driver against torch"
for i in 1 2; do
    s=$(date +%s.%N); python3 -c 'from snaketune import gpus; n = gpus.cuda_device_count(); print(n, gpus.cuda_devices(range(n)))'
    e=$(date +%s.%N); echo "  driver: $(python3 -c "print(f'{$e - $s:.2f} s')")"
    s=$(date +%s.%N); python3 -c 'import torch; n = torch.cuda.device_count(); print(n, [(p.name, p.total_memory / 2**30) for p in map(torch.cuda.get_device_properties, range(n))])'
    e=$(date +%s.%N); echo "  torch:  $(python3 -c "print(f'{$e - $s:.2f} s')")"
done

mkdir -p .realdata /tmp/smollm2
python3 -c 'import lzma, shutil; shutil.copyfileobj(lzma.open(".rm/c1/oasst_real.hf_rows.jsonl.xz"), open(".realdata/oasst_real.hf_rows.jsonl", "wb"))'
python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".rm/smol")).to(torch.bfloat16)
m.save_pretrained("/tmp/smollm2/smol-rand")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".rm/smol/{f}", f"/tmp/smollm2/smol-rand/{f}")
PY
cat > /tmp/stage_times.yaml <<'Y'
model: {base: /tmp/smollm2/smol-rand}
Y
echo "=== $(date -u +%T) workflow: SFT and DPO stages of the example"
timeout -k 10 420 python3 -m snakemake results/dpo/default/summary.json --scheduler greedy --cores 16 \
    --resources gpu=1 --configfile "$EXAMPLE" bench/configs/real_model.yaml /tmp/stage_times.yaml \
    > "$OUT/workflow.log" 2>&1
echo "=== $(date -u +%T) workflow exit $?"
for f in $(find benchmarks -name '*.tsv' | sort); do echo "  $f $(tail -1 "$f" | cut -f1) s"; done
grep -h "GPUs assigned\|launching\|first\|done:" logs/train/default.log logs/reference/default-*.log logs/dpo/default.log | cut -c1-160
# bench/real_model_trl.py reads the base model where rule import_gguf would have left it
mkdir -p results/models && ln -sfn /tmp/smollm2/smol-rand results/models/smol-rand
echo "=== $(date -u +%T) TRL padded (SFT, DPO)"
python3 bench/real_model_trl.py --run . --config "$EXAMPLE" bench/configs/real_model.yaml /tmp/stage_times.yaml \
    --out /tmp/trl_padded --mode padded --stages sft,dpo > "$OUT/trl_padded.log" 2>&1
echo "=== $(date -u +%T) TRL exit $?"
python3 -c 'import json; r = json.load(open("/tmp/trl_padded/trl.json")); print({k: round(r[k]["wall_s"], 1) for k in ("sft", "dpo") if k in r}, "imports", round(r["import_s"], 1))'
tar czf "$OUT/stage_times.tar.gz" benchmarks logs results/train/default/summary.json results/dpo/default/summary.json \
    /tmp/trl_padded/trl.json 2>/dev/null
