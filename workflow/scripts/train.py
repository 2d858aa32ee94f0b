import _stage

import json
from pathlib import Path

from snaketune.checkpoint import run_key as checkpoint_run_key
from snaketune.io import atomic_files
from snaketune.launch import launch
from snaketune.plan import apply_plan


def main(smk):
    spec = dict(smk.params.spec)
    run_key = checkpoint_run_key(spec["run_key"], smk.input.data)
    ckpt_dir = Path(smk.params.checkpoints) / run_key
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": spec["model"],
        "train": spec["train"],
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "checkpoint_dir": str(ckpt_dir),
        "max_length": spec["max_length"],
        "run_key": run_key,
    }
    # train.strategy auto: the DeepSpeed file and checkpointing the plan chose (and a run key naming them).
    plan = json.loads(Path(smk.input.plan).read_text())
    run_spec = apply_plan(run_spec, plan)
    ckpt_dir = Path(smk.params.checkpoints) / run_spec["run_key"]
    run_spec["checkpoint_dir"] = str(ckpt_dir)
    # The ranks write model/, metrics.csv, tb/ and summary.json into a staging directory, renamed into
    # place together once training has ended (snaketune.io.atomic_files); checkpoints are not outputs.
    with atomic_files(smk.output.model, smk.output.metrics, smk.output.tb, smk.output.summary) as staged:
        run_spec = {**run_spec, "output_dir": str(staged[0].parent)}
        launch(
            run_spec,
            ckpt_dir / "run-spec.json",
            granted=int(smk.resources.gpu),
            log_file=smk.log[0],
            threads=smk.threads,
            nodes=int(smk.resources.nodes),
            plan=plan,
        )


_stage.run(snakemake, main)
