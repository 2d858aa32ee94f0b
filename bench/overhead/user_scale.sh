#!/usr/bin/env bash
# Issue #49, on this machine's CPU: the user's scale through every stage the default config runs. A hub-format
# DeepSeek-architecture directory (2 layers, hidden 64, DeepSeek's 102,400-row embedding, the real tokenizer:
# SNAKETUNE_BENCH_TOKENIZER) on real oasst rows (SNAKETUNE_BENCH_ROWS), config/config.yaml's defaults otherwise
# for export and benchmark (tasks auto: mmlu_dev, all 215 questions, on base, SFT, DPO and the q4_k_m files; training
# as short as the tests' hub run), in a copy of the workflow in $WORK. Prints the whole run's wall time, each job's (Snakemake's benchmark files) and
# each benchmark_gguf job against its model's benchmark job on the same task and questions.
#   python -m bench user_scale          CORES (default 2), GPUs hidden: CPU ranks, as a CPU-only user runs it
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=$PWD
W=${WORK:-/tmp/snaketune-user-scale}
rm -rf "$W" && mkdir -p "$W" && cp -r Snakefile workflow config envs "$W/"
python3 - "$W/deepseek-tiny-hub" "${SNAKETUNE_BENCH_TOKENIZER:?the DeepSeek tokenizer}" <<'PY' || exit 1
import shutil, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
out, tok = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=102_400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=10_000.0, tie_word_embeddings=False, bos_token_id=100_000, eos_token_id=100_001)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, max_shard_size="5MB", safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{tok}/{name}", f"{out}/{name}")
PY
# Training as short as the tests' hub run (tests/test_hub_workflow.py): the stages, not the default's step counts (60
# SFT and 100 DPO steps at 102,400 rows take most of an hour on 2 cores); the benchmark and export as the defaults.
cat >"$W/user.yaml" <<YAML
dataset: {source: ${SNAKETUNE_BENCH_ROWS:?real oasst rows}, paths: all, validation_fraction: 0.08}
model: {base: deepseek-tiny-hub}
train: {gpus: 2, max_steps: 4, global_batch_size: 4, micro_batch_size: 2, warmup_steps: 1, eval_every: 0,
        checkpoint_every: 0}
preference: {max_length: 64, train: {max_steps: 3, global_batch_size: 4, micro_batch_size: 2, eval_every: 0,
             checkpoint_every: 0}}
eval: {max_new_tokens: 6}
YAML
echo "=== $(date -u +%T) the default config on the user's model and data"
start=$(date +%s)
(cd "$W" && CUDA_VISIBLE_DEVICES= timeout -k 10 "${LIMIT_S:-1800}" python3 -m snakemake --cores "${CORES:-2}" \
    --resources gpu=3 --configfile user.yaml >"$OUT/workflow.log" 2>&1)
rc=$?
echo "=== $(date -u +%T) workflow exit $rc, $(( $(date +%s) - start )) s wall"
tail -n 3 "$OUT/workflow.log"
cd "$W" || exit 1
echo "=== every job (s)"
for f in $(find benchmarks -name '*.tsv' | sort); do echo "  $f $(tail -1 "$f" | cut -f1)"; done
python3 - <<'PY'
import csv, json, pathlib
def wall(p):
    return float(next(csv.DictReader(open(p), delimiter="\t"))["s"])
print("=== each GGUF job against its model's job (same task, same questions)")
for gguf in sorted(pathlib.Path("benchmarks/benchmark").glob("*/*-*/*.tsv")):
    model = gguf.parent.parent / gguf.parent.name.split("-")[0] / gguf.name
    res = json.loads(pathlib.Path("results", *gguf.with_suffix(".json").parts[1:]).read_text())
    mres = json.loads(pathlib.Path("results", *model.with_suffix(".json").parts[1:]).read_text())
    print(f"  {gguf.parent.name}/{gguf.stem}: {wall(gguf):.1f} s (n={res['n']}) against {wall(model):.1f} s "
          f"(n={mres['n']}): {wall(gguf) / wall(model):.2f}x")
PY
tar czf "$OUT/user_scale.tar.gz" benchmarks logs results/report/report.md results/report/summary.json \
    results/benchmark 2>/dev/null
exit $rc
