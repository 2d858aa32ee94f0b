import _stage

from snaketune.data.conversations import build_conversations, read_messages, write_conversations
from snaketune.io import atomic_files


def main(smk):
    spec = smk.params.spec
    result = build_conversations(
        read_messages(smk.input.messages),
        languages=spec["languages"],
        paths=spec["paths"],
        validation_fraction=spec["validation_fraction"],
        tree_states=spec["tree_states"],
        source_name=smk.input.messages,
    )
    # All three files or none (snaketune.io.atomic_files).
    with atomic_files(*smk.output) as (train, _, _):
        write_conversations(result, train.parent)


_stage.run(snakemake, main)
