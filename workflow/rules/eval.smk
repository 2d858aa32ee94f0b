# Evaluation: base vs fine-tuned model on the validation split, the configured prompts and (builtin data)
# exact-match questions.


rule evaluate:
    input:
        unpack(evaluate_input),
    output:
        metrics=report(
            "results/eval/{experiment}/metrics.json",
            caption="../report/eval_metrics.rst",
            category="3. Evaluation",
            labels={"experiment": "{experiment}", "file": "metrics.json"},
        ),
        generations=report(
            "results/eval/{experiment}/generations.jsonl",
            caption="../report/eval_generations.rst",
            category="3. Evaluation",
            labels={"experiment": "{experiment}", "file": "generations.jsonl"},
        ),
    log:
        "logs/eval/{experiment}.log",
    benchmark:
        "benchmarks/eval/{experiment}.tsv"
    conda:
        "../../envs/train.yaml"
    # One core where the models run on a GPU or are small; every core for a larger model on a CPU (model_threads).
    threads: model_threads
    resources:
        gpu=1,
        gpu_memory_mib=gpu_memory_mib(),
    params:
        spec=evaluate_params,
    script:
        "../scripts/evaluate.py"
