import _stage

from snaketune.report.gate import check_drops


def main(smk):
    check_drops(smk.input.summary, smk.output.gate)


_stage.run(snakemake, main)
