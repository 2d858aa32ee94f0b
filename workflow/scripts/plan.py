import _stage

import os

from snaketune.plan.search import write_plan


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    write_plan(
        **spec,
        deepspeed_config=getattr(smk.input, "deepspeed", None),
        out=smk.output.plan,
        # A hub model's config.json (a few kB) when it is not cached yet; offline, the plan is "unknown".
        allow_download=not os.environ.get("HF_HUB_OFFLINE"),
    )


_stage.run(snakemake, main)
