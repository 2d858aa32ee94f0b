import _stage

from pathlib import Path

from snaketune.conversations import build_conversations, read_messages, write_conversations


def main(smk):
    spec = smk.params.spec
    result = build_conversations(
        read_messages(smk.input.messages),
        languages=spec["languages"],
        paths=spec["paths"],
        validation_fraction=spec["validation_fraction"],
        source_name=smk.input.messages,
    )
    write_conversations(result, Path(smk.output.train).parent)


_stage.run(snakemake, main)
