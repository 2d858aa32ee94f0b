# snaketune: oasst1-format conversations -> DeepSpeed fine-tuning of DeepSeek-architecture models.
#
# results/
# ├── models/<name>-<hash>/        a GGUF model.base as a hub-format directory        (rule import_gguf)
# ├── data/raw/                    messages.parquet, SHA256SUMS, source.json         (rule download)
# ├── data/conversations/          train.parquet, validation.parquet, stats.json     (rule conversations)
# ├── tokenizer/<tokenizer id>/    HF tokenizer with chat template              (rules train_tokenizer, fetch_tokenizer)
# ├── data/preferences/<pairs>/    train.parquet, validation.parquet, stats.json     (rule preferences)
# ├── tokenized/<data key>/        train/, validation/ (Arrow, save_to_disk), stats.json (rule tokenize)
# ├── tokenized_pairs/<pairs key>/ train/, validation/ (one row per pair), stats.json (rule tokenize_pairs)
# ├── plan/[dpo/|eval/]<experiment>.json  memory per GPU and host, what fits, the strategy a stage uses
# │                                (rules plan, plan_dpo, plan_eval)
# ├── train/<experiment>/          model/ (HF safetensors), metrics.csv, tb/, summary.json (rule train)
# ├── preference/<experiment>/     reference.parquet, reference.json: cached reference log-probs (rule reference)
# ├── dpo/<experiment>/            model/, metrics.csv, tb/, summary.json: preference-tuned (rule dpo)
# ├── eval/<experiment>/           metrics.json (base, SFT, DPO), generations.jsonl     (rule evaluate)
# ├── export/<experiment>/<model>/ <experiment>-<model>-{bf16,q8_0,q4_k_m}.gguf, metrics.json, replies.jsonl,
# │                                *.Modelfile (Ollama), serve.sh, README.md (llama.cpp's server)   (rule export)
# ├── benchmark/base/<key>/<task>.json, benchmark/<experiment>/<sft|dpo|sft-q4_k_m|...>/<task>.json
# │                                lm-evaluation-harness scores (rules benchmark_base, benchmark, benchmark_gguf)
# ├── provenance/                  manifest.json (rule manifest); <rule>[/<wildcards>].json per job (not outputs)
# └── report/                      index.html, report.md, summary.json, *.png          (rule report);
#                                  gate.json: no drop beyond benchmark.max_drop  (rule benchmark_gate, fail_on_drop)
#     checkpoints/<experiment>/    resumable DeepSpeed checkpoints (not an output: survives failures; removed
#                                  once the stage's outputs are in place unless train.keep_final_checkpoint)
#     hub_revisions.json           hub revisions pinned to commits (snaketune.hub), reused by later runs
# logs/ and benchmarks/ mirror the rules.

import re

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/common_report.smk"
include: "workflow/rules/common_train.smk"
include: "workflow/rules/common_plan.smk"
include: "workflow/rules/common_preference.smk"
include: "workflow/rules/common_benchmark.smk"


wildcard_constraints:
    experiment="|".join(re.escape(name) for name in EXPERIMENTS),  # a.b must not match axb
    key="[0-9a-f]{16}",
    tokenizer="[A-Za-z0-9-]+",
    pairs="best_vs_rest|all|file-[0-9a-f]{12}",
    gguf="[A-Za-z0-9-]+",
    model="sft|dpo",


include: "workflow/rules/model.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/preference.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/verify.smk"


rule all:
    default_target: True
    input:
        all_targets(),
        # Missing outputs of the config's jobs, which a plain run rebuilds (snaketune.verify; none once all is built).
        preflight(),
