import _stage

from pathlib import Path

from snaketune.launch import launch


def main(smk):
    spec = dict(smk.params.spec)
    run_key = spec["run_key"]
    out_dir = Path(smk.output.summary).parent
    ckpt_dir = Path(smk.params.checkpoints) / run_key
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": spec["model"],
        "train": spec["train"],
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "output_dir": str(out_dir),
        "checkpoint_dir": str(ckpt_dir),
        "max_length": spec["max_length"],
        "run_key": run_key,
    }
    launch(
        run_spec,
        ckpt_dir / "run-spec.json",
        granted=int(smk.resources.gpu),
        log_file=smk.log[0],
        threads=smk.threads,
    )


_stage.run(snakemake, main)
