import _stage

import json
from pathlib import Path

from snaketune.checkpoint import run_key as checkpoint_run_key
from snaketune.launch import train_job


def main(smk):
    spec = dict(smk.params.spec)
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": spec["model"],
        "train": spec["train"],
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "max_length": spec["max_length"],
        "run_key": checkpoint_run_key(spec["run_key"], smk.input.data),
    }
    train_job(
        run_spec,
        checkpoints=smk.params.checkpoints,
        outputs=(smk.output.model, smk.output.metrics, smk.output.tb, smk.output.summary),
        plan=json.loads(Path(smk.input.plan).read_text()),
        granted=int(smk.resources.gpu),
        log_file=smk.log[0],
        threads=smk.threads,
        nodes=int(smk.resources.nodes),
    )


_stage.run(snakemake, main)
