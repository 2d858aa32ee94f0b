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
    # Where it runs and its bookkeeping (checkpoint and logging cadence): resources, which no rerun trigger
    # compares, so changing them neither reruns a finished training nor renames its checkpoints.
    resources:
        **runtime_resources("train"),
        gpu=stage_gpus("train"),
        nodes=stage_nodes("train"),
        gres=stage_gres("train"),
    params:
        spec=train_params,
        checkpoints=checkpoints_dir("train"),
    script:
        "../scripts/train.py"
