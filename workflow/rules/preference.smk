# Preference tuning from the ranks oasst already has, or from a pairs file (preference.source): pairs -> tokenized
# pairs -> reference log-probabilities (once) -> DPO on the SFT model. Only experiments with preference.enabled.


rule preferences:
    input:
        unpack(preferences_input),
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        train=update("results/data/preferences/{pairs}/train.parquet"),
        validation=update("results/data/preferences/{pairs}/validation.parquet"),
        stats=update(
            report(
                "results/data/preferences/{pairs}/stats.json",
                caption="../report/preferences.rst",
                category="1. Data",
            )
        ),
    log:
        "logs/preferences/{pairs}.log",
    benchmark:
        "benchmarks/preferences/{pairs}.tsv"
    conda:
        "../../envs/data.yaml"
    params:
        spec=preferences_params,
    script:
        "../scripts/preferences.py"


rule tokenize_pairs:
    input:
        unpack(tokenize_pairs_input),
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        update(directory("results/tokenized_pairs/{key}")),
    log:
        "logs/tokenized_pairs/{key}.log",
    benchmark:
        "benchmarks/tokenized_pairs/{key}.tsv"
    priority: 1
    conda:
        "../../envs/data.yaml"
    threads: 8
    params:
        spec=tokenize_pairs_params,
    script:
        "../scripts/tokenize_pairs.py"


rule reference:
    input:
        unpack(reference_input),
    output:
        logprobs="results/preference/{experiment}/reference-{key}/reference.parquet",
        record="results/preference/{experiment}/reference-{key}/reference.json",
    log:
        "logs/reference/{experiment}-{key}.log",
    benchmark:
        "benchmarks/reference/{experiment}-{key}.tsv"
    conda:
        "../../envs/train.yaml"
    threads: train_threads
    resources:
        **runtime_resources("reference"),
        gpu=stage_gpus("reference"),
        nodes=stage_nodes("reference"),
        gres=stage_gres("reference"),
    params:
        spec=reference_params,
        checkpoints=checkpoints_dir("reference"),
    script:
        "../scripts/reference.py"


rule dpo:
    input:
        unpack(dpo_input),
    output:
        model=directory("results/dpo/{experiment}/model"),
        metrics=report(
            "results/dpo/{experiment}/metrics.csv",
            caption="../report/dpo_metrics.rst",
            category="2. Training",
            labels={"experiment": "{experiment}", "stage": "dpo"},
        ),
        tb=directory("results/dpo/{experiment}/tb"),
        summary=report(
            "results/dpo/{experiment}/summary.json",
            caption="../report/dpo_summary.rst",
            category="2. Training",
            labels={"experiment": "{experiment}", "stage": "dpo"},
        ),
    log:
        "logs/dpo/{experiment}.log",
    benchmark:
        "benchmarks/dpo/{experiment}.tsv"
    conda:
        "../../envs/train.yaml"
    threads: train_threads
    resources:
        **runtime_resources("dpo"),
        gpu=stage_gpus("dpo"),
        nodes=stage_nodes("dpo"),
        gres=stage_gres("dpo"),
    params:
        spec=dpo_params,
        checkpoints=checkpoints_dir("dpo"),
    script:
        "../scripts/dpo.py"
