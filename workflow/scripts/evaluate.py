import _stage

import json
from pathlib import Path

import torch

from snaketune import gpus
from snaketune.evaluation.evaluate import evaluate


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    torch.set_num_threads(smk.threads)
    plan = json.loads(Path(smk.input.plan).read_text())
    # The memory plan's batch size: eval.batch_size, or the largest that fits under gpu_memory_gib.
    spec["batch_size"] = (plan.get("evaluate") or {}).get("batch_size", spec["batch_size"])
    preference = {}
    if hasattr(smk.input, "dpo_model"):
        preference = {"dpo_dir": smk.input.dpo_model, "pairs_dir": smk.input.pairs}
    else:
        spec.pop("beta")
        spec.pop("reference")
    # A GPU of its own (set as CUDA_VISIBLE_DEVICES before CUDA starts in this process), held to the end.
    with gpus.in_process(int(smk.resources.gpu), label=f"evaluate {smk.wildcards.experiment}"):
        evaluate(
            **spec,
            **preference,
            tuned_dir=smk.input.model,
            train_summary=smk.input.summary,
            tokenizer_dir=Path(smk.input.tokenizer).parent,
            data_dir=smk.input.data,
            conversations_dir=Path(smk.input.conversations).parent,
            metrics_out=smk.output.metrics,
            generations_out=smk.output.generations,
            memory_cap_gib=plan.get("gpu_memory_gib"),
        )


_stage.run(snakemake, main)
