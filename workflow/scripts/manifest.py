import _stage

from snaketune.provenance import write_manifest


def main(smk):
    write_manifest(smk.input, smk.output.manifest)


# The manifest holds the records; a record of its own job would only repeat them.
_stage.run(snakemake, main, record=False)
