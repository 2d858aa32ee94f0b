"""What the train, reference and dpo rules run (their scripts call `train_rule_job`): the run spec from the rule's
params and inputs, the memory plan's strategy applied, the checkpoint directory named by the run key, the outputs
staged, and the rank processes started on the granted GPUs (snaketune.train.processes). A failed launch raises
LaunchError with the cause the ranks' output gives (snaketune.train.failures).
"""

from __future__ import annotations

import json
from pathlib import Path

from snaketune.io import atomic_files
from snaketune.plan.apply import apply_plan
from snaketune.train.processes import LaunchError, launch

__all__ = ["LaunchError", "launch", "train_job", "train_rule_job"]
"""LaunchError and launch are the processes module's: what a rule's launch raises, and the launch itself."""


def train_job(
    run_spec: dict,
    *,
    checkpoints: str | Path,
    outputs: tuple[str, ...],
    plan: dict,
    granted: int,
    log_file: str | Path,
    threads: int,
    nodes: int,
    module: str = "snaketune.train.trainer",
) -> None:
    """What the train and dpo rules run: the plan's strategy applied (train.strategy auto), the checkpoint
    directory named by the run key, and the ranks writing model/, metrics.csv, tb/ and summary.json into a
    staging directory that is renamed into place once training has ended (checkpoints are not outputs).
    `plan`: the stage's memory plan (results/plan/<experiment>.json; results/plan/dpo/ for the dpo rule)."""
    run_spec = apply_plan(run_spec, plan)
    ckpt_dir = Path(checkpoints) / run_spec["run_key"]
    run_spec["checkpoint_dir"] = str(ckpt_dir)
    with atomic_files(*outputs) as staged:
        run_spec = {**run_spec, "output_dir": str(staged[0].parent)}
        launch(
            run_spec,
            ckpt_dir / "run-spec.json",
            granted=granted,
            log_file=log_file,
            threads=threads,
            nodes=nodes,
            plan=plan,
            module=module,
        )


def train_rule_job(
    smk,
    *,
    model: dict,
    module: str = "snaketune.train.trainer",
    outputs: tuple | None = None,
    train: dict | None = None,
    **extra,
) -> None:
    """The train, reference and dpo rules' scripts: the run spec from the rule's params (spec) and inputs (data,
    tokenizer, deepspeed, plan), `extra` keys added, then train_job with the rule's outputs (default: model,
    metrics, tb, summary; all in one directory) and resources."""
    from snaketune.train.checkpoint import run_key  # torch: imported only where a training is launched

    spec = smk.params.spec
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": model,
        "train": train or spec["train"],
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "max_length": spec["max_length"],
        # Every input's content: a job that starts from other data or another model never resumes this one.
        "run_key": run_key(spec["run_key"], dict(smk.input.items())),
        **extra,
    }
    train_job(
        run_spec,
        checkpoints=smk.params.checkpoints,
        outputs=outputs or (smk.output.model, smk.output.metrics, smk.output.tb, smk.output.summary),
        plan=json.loads(Path(smk.input.plan).read_text()),
        granted=int(smk.resources.gpu),
        log_file=smk.log[0],
        threads=smk.threads,
        nodes=int(smk.resources.nodes),
        module=module,
    )
