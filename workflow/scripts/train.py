import _stage

from snaketune.train.launch import train_rule_job


def main(smk):
    train_rule_job(smk, model=smk.params.spec["model"])


_stage.run(snakemake, main)
