# Helpers of plan.smk and the machine's GPU settings, kept apart from the rules (snakemake --lint wants
# functions and rules in separate files).

import functools
import os

from snaketune import gpus  # noqa: E402
from snaketune.plan import arch as plan_arch
from snaketune.plan import search as plan

# The top-level config key gpu_ids reaches every job through the environment (snaketune.gpus reads
# SNAKETUNE_GPUS; a value set there wins): which GPUs a job runs on must not rerun it, as a param would.
if CFG.gpu_ids is not None:
    os.environ.setdefault(gpus.ENV_GPUS, ",".join(CFG.gpu_ids))

PLANS = {"train": "", "dpo": "dpo/", "evaluate": "eval/"}
"""The memory plans, one per stage that needs GPU memory, each a rule of its own (plan, plan_dpo, plan_eval) so that
a setting of one stage never reruns another's plan. Each stage makes its plan again where it starts, from the same
settings (snaketune.plan.search.stage_plan)."""


def plan_path(exp, stage):
    return f"results/plan/{PLANS[stage]}{exp.name}.json"


def plan_targets():
    """Every memory plan: the preflight check of each stage that needs GPU memory, and its record. No stage reads
    them (snaketune.plan.search.stage_plan says why), so `all` asks for them."""
    return [
        plan_path(exp, stage)
        for exp in EXPERIMENTS.values()
        for stage in PLANS
        if stage != "dpo" or exp.preference.enabled
    ]


def plan_input(stage):
    """The stage's DeepSpeed file and, with train.strategy auto, the files it chooses among (an edit to one reruns
    the plan); a GGUF model's imported directory (the plan reads its config.json)."""

    def files(wildcards):
        exp = experiment(wildcards)
        found = base_model_input(exp.model)
        if stage == "evaluate":
            return found
        train = stage_train(exp, stage)
        found["deepspeed"] = train.deepspeed
        if train.strategy == "auto":
            found.update(
                {Path(name).stem: path for name, path in plan.candidate_files().items()}
            )
        return found

    return files


def plan_params(stage):
    """What the stage's memory depends on (snaketune.config.owners: the train keys of facet MEMORY, or EVAL_MEMORY
    and the eval section for the evaluate stage), where it runs, and nothing else: a change reruns this plan, and
    the stage itself only where the change is also its own (no stage reads a plan file).
    """

    def params(wildcards):
        exp = experiment(wildcards)
        spec = {
            "experiment": exp.name,
            "model": owners.model_settings(exp.model),
            "gpu_memory_gib": CFG.gpu_memory_gib,
            "code": keys.code_hash("plan"),
        }
        if stage == "evaluate":
            return {
                **spec,
                "objective": "evaluate",
                "max_length": exp.tokenize.max_length,
                # QLoRA's models are evaluated in 4 bits ("none" unless LoRA quantizes).
                "train": {"lora": {"quantize": exp.train.lora.quantize}},
                "evaluation": {
                    "batch_size": CFG.eval.batch_size,
                    "max_new_tokens": CFG.eval.max_new_tokens,
                },
            }
        train = stage_train(exp, stage)
        return {
            **spec,
            # The preference stage: rows of both sides of a pair, its own log-probabilities (not train.loss_kernel).
            "objective": "sft" if stage == "train" else "preference",
            "max_length": (
                exp.tokenize.max_length
                if stage == "train"
                else 2 * exp.preference.max_length
            ),
            "train": {
                **owners.train_settings(train, owners.MEMORY),
                "gpus": train.gpus,
                "nodes": train.nodes,
            },
            # Paths only: their content matters under train.strategy auto (plan_input), else they feed the "what
            # would fit" message.
            "candidate_files": plan.candidate_files(),
        }

    return params


@functools.cache
def _cpu_only():
    """No GPU this run may use (none on the machine, or hidden: CUDA_VISIBLE_DEVICES, gpu_ids): the model stages
    run on the CPU."""
    try:
        return not gpus.candidates().visible
    except gpus.GpuError:
        return False


MANY_CORES_FROM = 20_000_000
"""Decoder parameters (the embeddings aside) from which a model's CPU jobs compute more than they import."""


@functools.cache
def _computes(base, num_layers, revision):
    """Whether a model's forward passes outweigh its job's start-up: its decoder's parameters (the plan's count of
    its architecture) from MANY_CORES_FROM, or an architecture not known before its import (a GGUF file's).
    """
    arch, _ = plan_arch.resolve_arch(
        {"base": base, "num_layers": num_layers, "revision": revision}
    )
    return arch is None or arch.layers * arch.layer_params() >= MANY_CORES_FROM


def model_threads(wildcards=None):
    """The cores of evaluate and the transformers benchmark jobs. One where the run has a GPU (their model runs
    there) or the models are small (the builtin one, the tests' hub-format ones: the job is mostly imports, two
    run side by side); every core Snakemake may use where a model that computes runs on the CPU (SmolLM2's
    evaluation on one core of two spent 200 s a model; bench/RESULTS.md, "The embedded default, the user's scale
    and the SmolLM2 example on a quiet CPU"). `--set-threads evaluate=N` overrides it.
    """
    models = {
        (e.model.base, e.model.num_layers, e.model.revision)
        for e in EXPERIMENTS.values()
    }
    return all_cores() if _cpu_only() and any(_computes(*m) for m in models) else 1
