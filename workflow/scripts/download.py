import _stage

from pathlib import Path

from snaketune.download import materialize


def main(smk):
    spec = smk.params.spec
    materialize(
        spec["source"],
        Path(smk.output.messages).parent,
        builtin_trees=spec["builtin_trees"],
        builtin_seed=spec["builtin_seed"],
    )


_stage.run(snakemake, main)
