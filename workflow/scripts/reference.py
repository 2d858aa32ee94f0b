import _stage

from snaketune.train.launch import train_rule_job


def main(smk):
    spec = smk.params.spec
    # The model DPO starts from, loaded the way DPO loads it: the SFT model (an input) or the base.
    model = spec["model"]
    if hasattr(smk.input, "policy"):
        model = {**model, "base": smk.input.policy, "num_layers": None}
    # No optimizer steps: the params leave out the batch and schedule (ReferencePass sets one micro-batch per rank).
    train = {**spec["train"], "global_batch_size": spec["train"]["micro_batch_size"]}
    train_rule_job(
        smk,
        model=model,
        train=train,
        module="snaketune.preference.reference",
        outputs=(smk.output.logprobs, smk.output.record),
        preference=spec["preference"],
    )


_stage.run(snakemake, main)
