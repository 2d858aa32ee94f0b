import _stage

from pathlib import Path

import torch

from snaketune.data.prompts import resolve_prompts
from snaketune.export.export import ExportJob, export


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    torch.set_num_threads(smk.threads)
    prompts = resolve_prompts(
        spec.pop("prompts"),
        builtin_dataset=spec.pop("builtin_dataset"),
        conversations_dir=Path(smk.input.conversations).parent,
    )
    job = ExportJob(
        **spec,
        prompts=[p["prompt"] for p in prompts],
        model_dir=smk.input.model,
        name=f"{smk.wildcards.experiment}-{smk.wildcards.model}",
        out_dir=smk.output[0],
        data_dir=smk.input.data,
        conversations=smk.input.conversations,
        threads=smk.threads,
        log_file=smk.log[0],
    )
    export(job)


_stage.run(snakemake, main)
