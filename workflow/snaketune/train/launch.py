"""What the train, reference and dpo rules run (their scripts call `train_rule_job`): the run spec from the rule's
params and inputs, the memory plan's strategy applied, the checkpoint directory named by the run key, the outputs
staged, and the rank processes started on the granted GPUs (snaketune.train.processes). A failed launch raises
LaunchError with the cause the ranks' output gives (snaketune.train.failures).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from snaketune.io import atomic_files
from snaketune.plan.apply import apply_plan
from snaketune.plan.budget import memory_cap_gib
from snaketune.train.processes import LaunchError, launch

__all__ = ["LaunchError", "launch", "train_job", "train_rule_job"]
"""LaunchError and launch are the processes module's: what a rule's launch raises, and the launch itself."""

log = logging.getLogger(__name__)


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
    staging directory that is renamed into place once training has ended (checkpoints are not outputs); then the
    stage's checkpoint directories go, unless train.keep_final_checkpoint keeps this run's.
    `plan`: the stage's memory plan (snaketune.plan.search.stage_plan, made where the job starts)."""
    from snaketune.train.checkpoint import remove_runs

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
    # The outputs are in place: the stage's checkpoints have done their work, a superseded run's and (unless kept)
    # this one's.
    keep = ckpt_dir if run_spec["train"].get("keep_final_checkpoint") else None
    for removed in remove_runs(checkpoints, keep=keep):
        log.info("removed checkpoint directory %s", removed)


def train_rule_job(
    smk,
    *,
    model: dict,
    module: str = "snaketune.train.trainer",
    outputs: tuple | None = None,
    train: dict | None = None,
    **extra,
) -> None:
    """The train, reference and dpo rules' scripts: the run spec from the rule's params (spec: what the stage's
    outputs depend on), resources (where it runs, its bookkeeping: snaketune.config.owners) and inputs (data,
    tokenizer, deepspeed), `extra` keys added, the stage's memory plan made here, then train_job with the rule's
    outputs (default: model, metrics, tb, summary; all in one directory)."""
    from snaketune.config.owners import full_train
    from snaketune.plan.search import as_configured, candidate_files, stage_plan
    from snaketune.train.checkpoint import run_key  # torch: imported only where a training is launched

    spec = smk.params.spec
    resources = smk.resources
    gres = getattr(resources, "gres", None)  # gpu:N per node, for a job of several nodes (gpu is then 0)
    gpus = int(resources.gpu) or (int(str(gres).split(":")[-1]) if gres else 1)
    train = full_train(train or spec["train"], resources, {"gpus": gpus, "nodes": int(resources.nodes)})
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": model,
        "train": train,
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "max_length": spec["max_length"],
        # Every input's content: a job that starts from other data or another model never resumes this one.
        "run_key": run_key(spec["run_key"], dict(smk.input.items())),
        **extra,
    }
    # The stage's memory plan, made here as its plan rule makes it (stage_plan says why it is not an input); the
    # preference stages' rows hold both sides of a pair. The reference pass takes no step: whether DPO fits is DPO's
    # plan's to say (rule plan_dpo, the dpo job); it follows that plan's choice only under strategy auto (its params
    # then hold what the choice depends on), else it builds the model as configured.
    sft = smk.rule == "train"
    cap = memory_cap_gib(resources)
    if smk.rule == "reference" and train["strategy"] != "auto":
        plan = as_configured(
            train, smk.input.deepspeed, cap, "as configured: the reference pass takes no step"
        )
    else:
        plan = stage_plan(
            experiment=smk.wildcards.experiment,
            model=spec["model"],
            train=train,
            max_length=spec["max_length"] * (1 if sft else 2),
            deepspeed_config=smk.input.deepspeed,
            gpu_memory_gib=cap,
            candidate_files=candidate_files(),
            objective="sft" if sft else "preference",
            allow_download=not os.environ.get("HF_HUB_OFFLINE"),
        )
    train_job(
        run_spec,
        checkpoints=smk.params.checkpoints,
        outputs=outputs or (smk.output.model, smk.output.metrics, smk.output.tb, smk.output.summary),
        plan=plan,
        granted=int(resources.gpu),
        log_file=smk.log[0],
        threads=smk.threads,
        nodes=int(resources.nodes),
        module=module,
    )
