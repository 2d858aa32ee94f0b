import _stage

from snaketune.data.download import materialize
from snaketune.io import atomic_files


def main(smk):
    spec = smk.params.spec
    # All three files or none: they are written into a staging directory and renamed into place together.
    with atomic_files(*smk.output) as (messages, _, _):
        materialize(
            spec["source"],
            messages.parent,
            builtin_trees=spec["builtin_trees"],
            builtin_seed=spec["builtin_seed"],
        )


_stage.run(snakemake, main)
