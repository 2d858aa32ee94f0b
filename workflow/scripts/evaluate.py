import _stage

import os
from pathlib import Path

import torch

from snaketune import gpus
from snaketune.evaluation.evaluate import EvalJob, evaluate
from snaketune.plan.budget import memory_cap_gib
from snaketune.plan.search import stage_plan


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    torch.set_num_threads(smk.threads)
    # The evaluate stage's memory plan, made here as rule plan_eval makes it: eval.batch_size, or the largest that
    # fits under gpu_memory_gib.
    cap = memory_cap_gib(smk.resources)
    plan = stage_plan(
        experiment=smk.wildcards.experiment,
        model=spec["model"],
        train={"lora": {"quantize": spec["quantize"]}},
        max_length=spec["max_prompt_tokens"],
        deepspeed_config=None,
        gpu_memory_gib=cap,
        evaluation={"batch_size": spec["batch_size"], "max_new_tokens": spec["max_new_tokens"]},
        objective="evaluate",
        allow_download=not os.environ.get("HF_HUB_OFFLINE"),
    )
    spec["batch_size"] = (plan.get("evaluate") or {}).get("batch_size", spec["batch_size"])
    preference = {}
    if hasattr(smk.input, "dpo_model"):
        preference = {"dpo_dir": smk.input.dpo_model, "pairs_dir": smk.input.pairs}
    else:
        spec.pop("beta")
        spec.pop("reference")
    # A GPU of its own (set as CUDA_VISIBLE_DEVICES before CUDA starts in this process), held to the end.
    with gpus.in_process(int(smk.resources.gpu), label=f"evaluate {smk.wildcards.experiment}"):
        job = EvalJob(
            **spec,
            **preference,
            tuned_dir=smk.input.model,
            train_summary=smk.input.summary,
            tokenizer_dir=Path(smk.input.tokenizer).parent,
            data_dir=smk.input.data,
            conversations_dir=Path(smk.input.conversations).parent,
            metrics_out=smk.output.metrics,
            generations_out=smk.output.generations,
            memory_cap_gib=cap,
        )
        evaluate(job)


_stage.run(snakemake, main)
