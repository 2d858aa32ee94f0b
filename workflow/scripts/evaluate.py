import _stage

from pathlib import Path

import torch

from snaketune.evaluate import evaluate


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    torch.set_num_threads(smk.threads)
    evaluate(
        **spec,
        tuned_dir=smk.input.model,
        train_summary=smk.input.summary,
        tokenizer_dir=Path(smk.input.tokenizer).parent,
        data_dir=smk.input.data,
        metrics_out=smk.output.metrics,
        generations_out=smk.output.generations,
    )


_stage.run(snakemake, main)
