import _stage

from snaketune.data.conversations import conversations_of_file, write_conversations
from snaketune.io import atomic_files


def main(smk):
    spec = smk.params.spec
    # paths and tree_states are oasst's: the params hold them only for oasst-format data.
    oasst = {k: spec[k] for k in ("paths", "tree_states") if k in spec}
    result = conversations_of_file(
        smk.input.messages,
        languages=spec["languages"],
        validation_fraction=spec["validation_fraction"],
        max_trees=spec["max_trees"],
        **oasst,
    )
    # All three files or none (snaketune.io.atomic_files).
    with atomic_files(*smk.output) as (train, _, _):
        write_conversations(result, train.parent)


_stage.run(snakemake, main)
