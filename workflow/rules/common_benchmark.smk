# Helpers of the benchmark rules (benchmark.smk) and of what the report reads from them. Kept apart from the rules:
# snakemake --lint wants functions and rules in separate files.

from snaketune.benchmark.local_tasks import definition_sha256, is_local  # noqa: E402
from snaketune.config.choices import EXPORT_QUANTS  # noqa: E402

BENCHMARK = CFG.benchmark
BUILTIN_DATA = CFG.dataset.source == "builtin"
BENCHMARK_TASKS = BENCHMARK.task_names(
    BUILTIN_DATA
)  # benchmark.tasks, auto resolved by the data
TASK_WILDCARD = "[A-Za-z0-9][A-Za-z0-9_.-]*"  # snaketune.config.benchmark.TASK_NAME


def base_key(exp):
    """What the base model's scores depend on besides the task: the model, and for a model built here (builtin)
    the seed and precision it is initialised with; the tokenizer and chat template; its 4-bit loading (QLoRA).
    Experiments that agree on these share one set of base scores."""
    built = exp.model.is_builtin
    return keys.short_hash(
        {
            "model": owners.model_settings(exp.model),
            "seed": exp.train.seed if built else None,
            "precision": exp.train.precision if built else None,
            "tokenizer": keys.tokenizer_id(exp.model),
            "chat_template": exp.tokenize.chat_template,
            "quantize": exp.train.lora.quantize,
        }
    )


BENCHMARK_BASES = {base_key(e): e for e in EXPERIMENTS.values()}


def benchmark_tuned(exp):
    """The experiment's transformers models the benchmark scores besides the base: sft, and dpo where it runs."""
    return [
        m
        for m in ("sft", "dpo")
        if m in BENCHMARK.models and (m == "sft" or exp.preference.enabled)
    ]


def benchmark_ggufs(exp):
    """`<model>-<quant>` of each exported file the benchmark scores."""
    quants = BENCHMARK.scored_quants(CFG.export.enabled, CFG.export.quants)
    return [f"{m}-{q}" for m in exported(exp) if m in BENCHMARK.models for q in quants]


def benchmark_results():
    """Every result file of the benchmark stage (none when it is off), task by task."""
    if not BENCHMARK.enabled:
        return []
    files = []
    for task in BENCHMARK_TASKS:
        if "base" in BENCHMARK.models:
            files += [
                f"results/benchmark/base/{k}/{task}.json" for k in BENCHMARK_BASES
            ]
        for name, exp in EXPERIMENTS.items():
            files += [
                f"results/benchmark/{name}/{m}/{task}.json"
                for m in benchmark_tuned(exp) + benchmark_ggufs(exp)
            ]
    return files


def benchmark_task(wildcards):
    """The task's spec: the section's settings for it, the same for every model and file, and the task file's hash
    for a local task (the harness's own tasks come with the pinned lm-eval).
    """
    if wildcards.task not in BENCHMARK_TASKS:
        raise WorkflowError(
            f"benchmark task {wildcards.task!r} is not in benchmark.tasks ({', '.join(BENCHMARK_TASKS)})"
        )
    spec = BENCHMARK.task_spec(wildcards.task)
    spec["definition"] = (
        definition_sha256(wildcards.task) if is_local(wildcards.task) else "lm-eval"
    )
    return spec


def _benchmark_spec(exp, source, task):
    return {
        "source": {**source, "model": owners.model_settings(exp.model)},
        "task": task,
        "chat_template": exp.tokenize.chat_template,
        "batch_size": BENCHMARK.batch_size,
        "max_length": BENCHMARK.max_length,
    }


def benchmark_base_input(wildcards):
    exp = BENCHMARK_BASES[wildcards.key]
    return {
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        **base_model_input(exp.model),
    }


def benchmark_base_params(wildcards):
    exp = BENCHMARK_BASES[wildcards.key]
    built = (
        exp.model.is_builtin
    )  # a builtin model is initialised from the seed, in the training precision
    source = {
        "kind": "base",
        "label": "base",
        "seed": exp.train.seed if built else None,
        "precision": exp.train.precision if built else None,
        "quantize": exp.train.lora.quantize,
    }
    return {
        **_benchmark_spec(exp, source, benchmark_task(wildcards)),
        "code": keys.code_hash("benchmark"),
    }


def benchmark_model_dir(exp, model):
    return (
        f"results/train/{exp.name}/model" if model == "sft" else f"{dpo_dir(exp)}/model"
    )


def benchmark_input(wildcards):
    exp = experiment(wildcards)
    return {
        "model": benchmark_model_dir(exp, wildcards.model),
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
    }


def benchmark_params(wildcards):
    exp = experiment(wildcards)
    source = {
        "kind": "tuned",
        "label": wildcards.model,
        "experiment": exp.name,
        "quantize": exp.train.lora.quantize,
    }
    return {
        **_benchmark_spec(exp, source, benchmark_task(wildcards)),
        "code": keys.code_hash("benchmark"),
    }


def benchmark_gguf_input(wildcards):
    exp = experiment(wildcards)
    return {
        "export": f"results/export/{exp.name}/{wildcards.model}",
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
    }


def benchmark_gguf_params(wildcards):
    exp = experiment(wildcards)
    source = {
        "kind": "gguf",
        "label": f"{wildcards.model}-{wildcards.quant}",
        "experiment": exp.name,
        "file": f"{exp.name}-{wildcards.model}-{wildcards.quant}.gguf",
    }
    return {
        **_benchmark_spec(exp, source, benchmark_task(wildcards)),
        "code": keys.code_hash("benchmark"),
    }
