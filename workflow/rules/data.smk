# Data stages: download -> conversations -> tokenizer -> tokenize.


rule download:
    input:
        download_input(),
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        messages=update("results/data/raw/messages.parquet"),
        sums=update("results/data/raw/SHA256SUMS"),
        source=update(
            report(
                "results/data/raw/source.json",
                caption="../report/download.rst",
                category="1. Data",
            )
        ),
    log:
        "logs/download.log",
    benchmark:
        "benchmarks/download.tsv"
    conda:
        "../../envs/data.yaml"
    params:
        spec=download_params(),
    script:
        "../scripts/download.py"


rule conversations:
    input:
        messages=rules.download.output.messages,
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        train=update("results/data/conversations/train.parquet"),
        validation=update("results/data/conversations/validation.parquet"),
        stats=update(
            report(
                "results/data/conversations/stats.json",
                caption="../report/conversations.rst",
                category="1. Data",
            )
        ),
    log:
        "logs/conversations.log",
    benchmark:
        "benchmarks/conversations.tsv"
    conda:
        "../../envs/data.yaml"
    params:
        spec=conversations_params(),
    script:
        "../scripts/conversations.py"


rule train_tokenizer:
    input:
        train=rules.conversations.output.train,
    output:
        tokenizer="results/tokenizer/builtin/tokenizer.json",
        config="results/tokenizer/builtin/tokenizer_config.json",
    log:
        "logs/tokenizer/builtin.log",
    benchmark:
        "benchmarks/tokenizer/builtin.tsv"
    conda:
        "../../envs/data.yaml"
    params:
        vocab_size=1024,
        code=keys.code_hash("tokenizer"),
    script:
        "../scripts/train_tokenizer.py"


rule fetch_tokenizer:
    input:
        unpack(fetch_tokenizer_input),
    output:
        tokenizer="results/tokenizer/{tokenizer}/tokenizer.json",
    log:
        "logs/tokenizer/{tokenizer}.log",
    conda:
        "../../envs/data.yaml"
    params:
        spec=fetch_tokenizer_params,
    script:
        "../scripts/fetch_tokenizer.py"


ruleorder: train_tokenizer > fetch_tokenizer


rule tokenize:
    input:
        unpack(tokenize_input),
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        update(directory("results/tokenized/{key}")),
    log:
        "logs/tokenized/{key}.log",
    benchmark:
        "benchmarks/tokenized/{key}.tsv"
    # Before tokenize_pairs and train when all are ready (a fixed order: tests/test_faults.py kills each).
    priority: 2
    conda:
        "../../envs/data.yaml"
    # The Rust tokenizer encodes each batch on this many threads (capped at --cores); the output is the same.
    threads: 8
    params:
        spec=tokenize_params,
    script:
        "../scripts/tokenize_data.py"
