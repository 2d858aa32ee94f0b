# Preflight memory plans: does each stage that needs GPU memory fit the GPUs, and if not, what would
# (snaketune.plan.search). Cheap, and first (priority), so a recipe that does not fit stops early. One rule per
# stage, so that a setting of one stage never reruns another's plan. No stage reads these files: each makes its
# plan again where it starts (snaketune.plan.search.stage_plan), so where a stage runs never reruns it.


rule plan:
    input:
        unpack(plan_input("train")),
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
        spec=plan_params("train"),
    script:
        "../scripts/plan.py"


# The preference stage's plan.
rule plan_dpo:
    input:
        unpack(plan_input("dpo")),
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
        spec=plan_params("dpo"),
    script:
        "../scripts/plan.py"


# The evaluate stage's plan: its batch size under the memory cap.
rule plan_eval:
    input:
        unpack(plan_input("evaluate")),
    output:
        plan="results/plan/eval/{experiment}.json",
    log:
        "logs/plan/eval/{experiment}.log",
    priority: 50
    localrule: True
    conda:
        "../../envs/train.yaml"
    threads: 1
    params:
        spec=plan_params("evaluate"),
    script:
        "../scripts/plan.py"
