import _stage

from pathlib import Path

from snaketune.io import atomic_dir
from snaketune.data.tokenizer import fetch_tokenizer


def main(smk):
    spec = smk.params.spec
    # save_pretrained writes several files in place: the whole directory appears at once.
    with atomic_dir(Path(smk.output.tokenizer).parent) as out_dir:
        fetch_tokenizer(
            spec["name"],
            out_dir,
            revision=spec["revision"],
            trust_remote_code=spec["trust_remote_code"],
        )


_stage.run(snakemake, main)
