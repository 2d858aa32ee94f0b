# Helpers of plan.smk and the machine's GPU settings, kept apart from the rules (snakemake --lint wants
# functions and rules in separate files).

import os

from snaketune import gpus  # noqa: E402
from snaketune.plan import search as plan

# The top-level config key gpu_ids reaches every job through the environment (snaketune.gpus reads
# SNAKETUNE_GPUS; a value set there wins): which GPUs a job runs on must not rerun it, as a param would.
if CFG.gpu_ids is not None:
    os.environ.setdefault(gpus.ENV_GPUS, ",".join(CFG.gpu_ids))


def plan_path(exp):
    return f"results/plan/{exp.name}.json"


def candidate_deepspeed_files():
    """The shipped DeepSpeed files that train.strategy auto chooses among (snaketune.plan.search.STRATEGIES)."""
    names = sorted({s.deepspeed_file for s in plan.STRATEGIES})
    return {
        name: f"config/deepspeed/{name}"
        for name in names
        if Path(f"config/deepspeed/{name}").exists()
    }


def plan_input(wildcards):
    """The configured DeepSpeed file; with train.strategy auto also the files it chooses among, so that an
    edit to one reruns the plan (and through it training)."""
    exp = experiment(wildcards)
    return _plan_files(exp.train, exp.model)


def _plan_files(train, model):
    """The DeepSpeed files, and a GGUF model's imported directory (the plan reads its config.json)."""
    files = {"deepspeed": train.deepspeed, **base_model_input(model)}
    if train.strategy == "auto":
        files.update(
            {
                Path(name).stem: path
                for name, path in candidate_deepspeed_files().items()
            }
        )
    return files


def plan_params(wildcards):
    """What the memory of the training depends on (its change reruns the plan and, as the plan is an input
    of train, training). The other shipped DeepSpeed files only feed the "what would fit" message unless
    train.strategy is auto."""
    exp = experiment(wildcards)
    return {
        "experiment": exp.name,
        "model": to_dict(exp.model),
        "train": to_dict(exp.train),
        "max_length": exp.tokenize.max_length,
        "gpu_memory_gib": CFG.gpu_memory_gib,
        "evaluation": {
            "batch_size": CFG.eval.batch_size,
            "max_new_tokens": CFG.eval.max_new_tokens,
            "quantize": exp.train.lora.quantize,
        },
        "candidate_files": candidate_deepspeed_files(),
        "code": keys.code_hash("plan"),
    }


def plan_dpo_path(exp):
    return f"results/plan/dpo/{exp.name}.json"


def plan_dpo_input(wildcards):
    exp = experiment(wildcards)
    return _plan_files(exp.dpo_train, exp.model)


def plan_dpo_params(wildcards):
    """The preference stage's memory: its merged train settings (train with preference.train over it), rows of
    both sides of a pair. A plan of its own, so that a preference setting never reruns SFT training.
    """
    exp = experiment(wildcards)
    return {
        "experiment": exp.name,
        "model": to_dict(exp.model),
        "train": to_dict(exp.dpo_train),
        "max_length": 2 * exp.preference.max_length,
        "gpu_memory_gib": CFG.gpu_memory_gib,
        "evaluation": None,
        "objective": "preference",  # its own log-probabilities, not train.loss_kernel
        "candidate_files": candidate_deepspeed_files(),
        "code": keys.code_hash("plan"),
    }
