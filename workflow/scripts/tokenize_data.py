import _stage

from pathlib import Path

from snaketune.data.tokenization import tokenize_conversations


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    tokenize_conversations(
        Path(smk.input.train).parent,
        Path(smk.input.tokenizer).parent,
        smk.output[0],
        **spec,
        threads=smk.threads,
    )


_stage.run(snakemake, main)
