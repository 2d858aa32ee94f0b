import _stage

from pathlib import Path

from snaketune.tokenizer import conversation_texts, train_tokenizer


def main(smk):
    out_dir = Path(smk.output.tokenizer).parent
    train_tokenizer(conversation_texts(smk.input.train), smk.params.vocab_size, out_dir)


_stage.run(snakemake, main)
