# Every output of the current config's jobs hashed against its provenance record (snaketune.verify):
# `snakemake --cores all verify` says what differs and how to rebuild it.


rule verify:
    log:
        "logs/verify.log",
    localrule: True
    conda:
        "../../envs/report.yaml"
    threads: max(os.cpu_count() or 1, 1)
    params:
        outputs=workflow_outputs(),
        code=keys.code_hash("verify"),
    script:
        "../scripts/verify.py"
