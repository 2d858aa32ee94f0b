# Training: DeepSpeed ranks across the GPUs Snakemake grants (CPU ranks over gloo without CUDA).


rule train:
    input:
        unpack(train_input),
    output:
        model=directory("results/train/{experiment}/model"),
        metrics=report(
            "results/train/{experiment}/metrics.csv",
            caption="../report/train_metrics.rst",
            category="2. Training",
            labels={"experiment": "{experiment}"},
        ),
        tb=directory("results/train/{experiment}/tb"),
        summary=report(
            "results/train/{experiment}/summary.json",
            caption="../report/train_summary.rst",
            category="2. Training",
            labels={"experiment": "{experiment}"},
        ),
    log:
        "logs/train/{experiment}.log",
    benchmark:
        "benchmarks/train/{experiment}.tsv"
    conda:
        "../../envs/train.yaml"
    threads: train_threads
    resources:
        gpu=train_gpus,
        nodes=train_nodes,
        gres=train_gres,
    params:
        spec=train_params,
        checkpoints=lambda wc: f"results/checkpoints/{wc.experiment}",
    script:
        "../scripts/train.py"
