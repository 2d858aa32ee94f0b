import _stage

from snaketune.io import atomic_files
from snaketune.data.tokenizer import conversation_texts, train_tokenizer


def main(smk):
    # train_tokenizer writes in place: both files go to a staging directory and are renamed together.
    with atomic_files(*smk.output) as (tokenizer, _):
        train_tokenizer(conversation_texts(smk.input.train), smk.params.vocab_size, tokenizer.parent)


_stage.run(snakemake, main)
