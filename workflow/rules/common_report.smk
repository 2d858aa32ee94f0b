# Helpers of the evaluate and report rules (eval.smk, report.smk). Kept apart from the rules: snakemake
# --lint wants functions and rules in separate files.


def resolved_config():
    """The config as the workflow uses it: defaults filled in, experiment overrides merged."""
    return {
        "dataset": to_dict(CFG.dataset),
        "experiments": {
            name: {
                **{
                    s: to_dict(getattr(exp, s))
                    for s in ("model", "tokenize", "train", "preference")
                },
                "dpo_train": to_dict(exp.dpo_train),
            }
            for name, exp in EXPERIMENTS.items()
        },
        "eval": to_dict(CFG.eval),
        "export": to_dict(CFG.export),
        "benchmark": {
            **to_dict(CFG.benchmark),
            "tasks": list(BENCHMARK_TASKS),
            "tasks_reason": BENCHMARK.tasks_reason(BUILTIN_DATA),
        },
    }


# ---- evaluate ------------------------------------------------------------------------------------


def evaluate_input(wildcards):
    exp = experiment(wildcards)
    files = {
        "model": f"results/train/{exp.name}/model",
        "summary": f"results/train/{exp.name}/summary.json",
        "data": tokenized_dir(exp),
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "conversations": "results/data/conversations/validation.parquet",  # eval.prompts auto
        **base_model_input(exp.model),  # the base model is evaluated too
    }
    if exp.preference.enabled:
        files.update(dpo_model=f"{dpo_dir(exp)}/model", pairs=pairs_dir(exp))
    return files


def evaluate_params(wildcards):
    """Eval settings and what identifies the models, nothing else: a changed prompt reruns the evaluation,
    never training. The fine-tuned model is an input; the base is named by model, seed and dataset.
    """
    exp = experiment(wildcards)
    return {
        **to_dict(CFG.eval),
        "model": owners.model_settings(exp.model),
        "seed": exp.train.seed,
        "chat_template": exp.tokenize.chat_template,
        "builtin_dataset": exp.dataset.source == "builtin",
        "max_prompt_tokens": exp.tokenize.max_length,
        "beta": exp.preference.beta if exp.preference.enabled else None,
        "reference": exp.preference.reference,
        "quantize": exp.train.lora.quantize,  # QLoRA's models are evaluated in 4 bits, as they trained
        "code": keys.code_hash("evaluate"),
    }


# ---- export --------------------------------------------------------------------------------------


def exported(exp):
    """The models of an experiment the export stage makes GGUF files of (export.models; dpo where it runs)."""
    if not CFG.export.enabled:
        return []
    return [
        m
        for m in CFG.export.models
        if m == "sft" or (m == "dpo" and exp.preference.enabled)
    ]


EXPORTS = [(n, m) for n, e in EXPERIMENTS.items() for m in exported(e)]


def export_input(wildcards):
    exp = experiment(wildcards)
    model = (
        f"results/train/{exp.name}/model"
        if wildcards.model == "sft"
        else f"{dpo_dir(exp)}/model"
    )
    return {
        "model": model,
        "data": tokenized_dir(
            exp
        ),  # the held-out conversations the files are scored on
        "conversations": "results/data/conversations/validation.parquet",  # eval.prompts auto
    }


def export_params(wildcards):
    """Export settings, and the eval prompts and lengths the replies are compared on: a changed export setting
    reruns export and report only."""
    exp = experiment(wildcards)
    spec = to_dict(CFG.export)
    return {
        "outtype": spec["outtype"],
        "quants": spec["quants"],
        "max_kl": CFG.export.thresholds(),
        "eval_tokens": spec["eval_tokens"],
        "prompts": (
            CFG.eval.prompts
            if isinstance(CFG.eval.prompts, str)
            else list(CFG.eval.prompts)
        ),
        "max_new_tokens": CFG.eval.max_new_tokens,
        "max_prompt_tokens": exp.tokenize.max_length,
        "builtin_dataset": exp.dataset.source == "builtin",
        # What the export loads: the trained model's directory, with the model's own code where it has some.
        "trust_remote_code": owners.model_settings(exp.model).get(
            "trust_remote_code", False
        ),
        "code": keys.code_hash("export"),
    }


# ---- report --------------------------------------------------------------------------------------


def manifest_input(wildcards):
    """Every experiment's outputs (lists in the order of EXPERIMENTS) and the data stages' stats: what the
    report is made from, and where the manifest starts following provenance records back.
    """
    names = list(EXPERIMENTS)
    return {
        "source": "results/data/raw/source.json",
        "sha256sums": "results/data/raw/SHA256SUMS",
        "conversations": "results/data/conversations/stats.json",
        "tokenized": [tokenized_dir(EXPERIMENTS[n]) for n in names],
        "summaries": [f"results/train/{n}/summary.json" for n in names],
        "metrics": [f"results/train/{n}/metrics.csv" for n in names],
        "evals": [f"results/eval/{n}/metrics.json" for n in names],
        "generations": [f"results/eval/{n}/generations.jsonl" for n in names],
        # The preference stages, for the experiments that run them (report_params names them, in order).
        "preferences": [
            f"{preferences_dir(e)}/stats.json" for e in PREFERENCE_EXPERIMENTS.values()
        ],
        "pairs": [pairs_dir(e) for e in PREFERENCE_EXPERIMENTS.values()],
        "references": [
            f"{reference_dir(e)}/reference.json"
            for e in PREFERENCE_EXPERIMENTS.values()
        ],
        "dpo_summaries": [
            f"{dpo_dir(e)}/summary.json" for e in PREFERENCE_EXPERIMENTS.values()
        ],
        "dpo_metrics": [
            f"{dpo_dir(e)}/metrics.csv" for e in PREFERENCE_EXPERIMENTS.values()
        ],
        "exports": [f"results/export/{n}/{m}" for n, m in EXPORTS],
        "benchmark": benchmark_results(),  # lm-evaluation-harness scores (common_benchmark.smk)
    }


def workflow_outputs():
    """What the current config's jobs write, as far as needed to tell their provenance records from those of other
    configs (snaketune.verify.current_records: a record with an output here is current): the report's inputs, what
    rule all asks for, and what neither names (the models, the tokenizers, imported GGUF models).
    """
    files = list(all_targets())
    for value in manifest_input(None).values():
        files += [value] if isinstance(value, str) else list(value)
    for exp in EXPERIMENTS.values():
        files += [
            f"results/train/{exp.name}/model",
            f"{tokenizer_dir(exp)}/tokenizer.json",
        ]
        files += list(base_model_input(exp.model).values())
    files += [f"{dpo_dir(e)}/model" for e in PREFERENCE_EXPERIMENTS.values()]
    return sorted(set(files))


def report_input(wildcards):
    return {**manifest_input(wildcards), "manifest": "results/provenance/manifest.json"}


def invocation():
    """--configfile (relative to the working directory when inside it), each with its sha256, and --config as given
    to Snakemake: the report's reproduce box. Only what changes the results: --cores and --resources are not here,
    so a run with other ones reruns nothing (an edit of a config file reruns the report, which names it by hash).
    """
    files = []
    for f in workflow.config_settings.configfiles:
        try:
            files.append(Path(f).relative_to(Path.cwd()).as_posix())
        except ValueError:
            files.append(str(f))
    return {
        "configfiles": files,
        "configfile_sha256": {f: sha256_file(f) for f in files if Path(f).is_file()},
        "config_args": list(workflow.config_settings.config_args or []),
    }


def report_params():
    return {
        "experiments": list(EXPERIMENTS),
        "preference_experiments": list(PREFERENCE_EXPERIMENTS),
        "exports": [list(e) for e in EXPORTS],
        "config": resolved_config(),
        "invocation": invocation(),
        "benchmark_bases": {n: base_key(e) for n, e in EXPERIMENTS.items()},
        # Benchmarks are not inputs (a missing one must not rerun its job): the report shows what exists.
        "benchmarks": "benchmarks",
        "code": keys.code_hash("report"),
    }
