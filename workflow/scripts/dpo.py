import _stage

from snaketune.train.launch import train_rule_job


def main(smk):
    spec = smk.params.spec
    # The policy starts from the SFT model the train stage saved (a hub-format directory).
    model = {**spec["model"], "base": smk.input.policy, "num_layers": None}
    train_rule_job(
        smk,
        model=model,
        module="snaketune.preference.dpo",
        preference={**spec["preference"], "reference_logprobs": smk.input.reference},
    )


_stage.run(snakemake, main)
