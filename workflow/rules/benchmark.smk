# Benchmark: lm-evaluation-harness tasks (benchmark.tasks) on each experiment's base, SFT and DPO model and on its
# exported GGUF files run by llama.cpp in the job's process, one job per model and task (snaketune.benchmark.run): a new
# task runs only its own jobs; the base model's scores are shared by the experiments that share it.


rule benchmark_base:
    input:
        unpack(benchmark_base_input),
    output:
        report(
            "results/benchmark/base/{key}/{task}.json",
            caption="../report/benchmark.rst",
            category="3. Evaluation",
            labels={"model": "base", "task": "{task}"},
        ),
    log:
        "logs/benchmark/base/{key}/{task}.log",
    benchmark:
        "benchmarks/benchmark/base/{key}/{task}.tsv"
    wildcard_constraints:
        task=TASK_WILDCARD,
    conda:
        "../../envs/benchmark.yaml"
    threads: model_threads  # as evaluate's
    resources:
        gpu=1,
    params:
        spec=benchmark_base_params,
    script:
        "../scripts/benchmark.py"


rule benchmark:
    input:
        unpack(benchmark_input),
    output:
        report(
            "results/benchmark/{experiment}/{model}/{task}.json",
            caption="../report/benchmark.rst",
            category="3. Evaluation",
            labels={
                "experiment": "{experiment}",
                "model": "{model}",
                "task": "{task}",
            },
        ),
    log:
        "logs/benchmark/{experiment}/{model}/{task}.log",
    benchmark:
        "benchmarks/benchmark/{experiment}/{model}/{task}.tsv"
    wildcard_constraints:
        task=TASK_WILDCARD,
    conda:
        "../../envs/benchmark.yaml"
    threads: model_threads  # as evaluate's
    resources:
        gpu=1,
    params:
        spec=benchmark_params,
    script:
        "../scripts/benchmark.py"


rule benchmark_gguf:
    input:
        unpack(benchmark_gguf_input),
    output:
        report(
            "results/benchmark/{experiment}/{model}-{quant}/{task}.json",
            caption="../report/benchmark.rst",
            category="3. Evaluation",
            labels={
                "experiment": "{experiment}",
                "model": "{model}-{quant}",
                "task": "{task}",
            },
        ),
    log:
        "logs/benchmark/{experiment}/{model}-{quant}/{task}.log",
    benchmark:
        "benchmarks/benchmark/{experiment}/{model}-{quant}/{task}.tsv"
    wildcard_constraints:
        quant="|".join(EXPORT_QUANTS),
        task=TASK_WILDCARD,
    conda:
        "../../envs/benchmark.yaml"
    threads: all_cores
    params:
        spec=benchmark_gguf_params,
    script:
        "../scripts/benchmark.py"
