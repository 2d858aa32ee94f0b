import _stage

from pathlib import Path

from snaketune.tokenizer import fetch_tokenizer


def main(smk):
    spec = smk.params.spec
    fetch_tokenizer(
        spec["name"],
        Path(smk.output.tokenizer).parent,
        revision=spec["revision"],
        trust_remote_code=spec["trust_remote_code"],
    )


_stage.run(snakemake, main)
