import _stage

from pathlib import Path

from snaketune.io import atomic_files
from snaketune.data.readers import read_messages
from snaketune.data.pair_format import build_pair_preferences
from snaketune.data.preferences import build_preferences, read_split_of_trees, write_preferences


def main(smk):
    spec = smk.params.spec
    if "pairs_file" in spec:  # preference.source: a pairs file
        result = build_pair_preferences(smk.input.pairs, validation_fraction=spec["validation_fraction"])
    else:  # the ranks of the dataset's replies
        result = build_preferences(
            read_messages(smk.input.messages),
            read_split_of_trees(Path(smk.input.train).parent),
            pairs=spec["pairs"],
            languages=spec["languages"],
            tree_states=spec["tree_states"],
            source_name=smk.input.messages,
        )
    # All three files or none (snaketune.io.atomic_files).
    with atomic_files(*smk.output) as (train, _, _):
        write_preferences(result, train.parent)


_stage.run(snakemake, main)
