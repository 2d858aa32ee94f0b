# Preflight memory plan: does the training fit the GPUs, and if not, what would (snaketune.plan.search). Cheap, so
# it runs first and stops the workflow before any training starts.


rule plan:
    input:
        unpack(plan_input),
    output:
        plan="results/plan/{experiment}.json",
    log:
        "logs/plan/{experiment}.log",
    priority: 50
    localrule: True
    conda:
        "../../envs/train.yaml"
    threads: 1
    params:
        spec=plan_params,
    script:
        "../scripts/plan.py"


# The preference stage's plan (its own file: a preference setting never reruns SFT training).
rule plan_dpo:
    input:
        unpack(plan_dpo_input),
    output:
        plan="results/plan/dpo/{experiment}.json",
    log:
        "logs/plan/dpo/{experiment}.log",
    priority: 50
    localrule: True
    conda:
        "../../envs/train.yaml"
    threads: 1
    params:
        spec=plan_dpo_params,
    script:
        "../scripts/plan.py"
