import _stage

from snaketune.data.download import materialize
from snaketune.io import atomic_files


def main(smk):
    spec = smk.params.spec
    builtin = spec.get("builtin", {})
    # All three files or none: they are written into a staging directory and renamed into place together.
    with atomic_files(*smk.output) as (messages, _, _):
        materialize(
            spec["source"],
            messages.parent,
            builtin_trees=builtin.get("trees", 1000),
            builtin_seed=builtin.get("seed", 0),
            revision=spec.get("revision", "main"),
            fmt=spec["format"],
        )


_stage.run(snakemake, main)
