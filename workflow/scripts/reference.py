import _stage

import json
from pathlib import Path

import torch

from snaketune import gpus
from snaketune.reference import compute_reference


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    torch.set_num_threads(smk.threads)
    plan = json.loads(Path(smk.input.plan).read_text())
    # A GPU of its own (set as CUDA_VISIBLE_DEVICES before CUDA starts in this process), held to the end.
    with gpus.in_process(int(smk.resources.gpu), label=f"reference {smk.wildcards.experiment}"):
        compute_reference(
            **spec,
            sft_dir=smk.input.get("model", ""),
            train_summary=smk.input.summary,
            tokenizer_dir=Path(smk.input.tokenizer).parent,
            pairs_dir=smk.input.pairs,
            out=smk.output.logprobs,
            record_out=smk.output.record,
            memory_cap_gib=plan.get("gpu_memory_gib"),
        )


_stage.run(snakemake, main)
