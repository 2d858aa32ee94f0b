# Helpers of the rules that start training ranks (train, reference, dpo): one function per concern, the stage as its
# argument. Kept apart from the rules: snakemake --lint wants functions and rules in separate files.

TRAIN_STAGES = ("train", "reference", "dpo")


def stage_train(exp, stage):
    """The train settings a stage runs with: `train` for SFT, `preference.train` merged over it for the preference
    stages (ExperimentConfig.dpo_train)."""
    return exp.train if stage == "train" else exp.dpo_train


def placement(train):
    """Where a stage runs, and the DeepSpeed files the plan chooses among: under train.strategy auto the plan's
    choice follows them, so a stage that trains holds them in its params then (snaketune.config.owners).
    """
    return {
        "gpus": train.gpus,
        "nodes": train.nodes,
        "gpu_memory_gib": CFG.gpu_memory_gib,
        "candidate_files": {
            name: sha256_file(path) for name, path in plan.candidate_files().items()
        },
    }


def train_settings(exp, stage, facet):
    """The values of the stage's train keys with `facet` (snaketune.config.owners.TRAIN_FIELDS)."""
    train = stage_train(exp, stage)
    return owners.train_settings(train, facet, placement=placement(train))


def train_input(wildcards):
    exp = experiment(wildcards)
    return {
        "data": tokenized_dir(exp),
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "deepspeed": exp.train.deepspeed,
        **base_model_input(exp.model),
    }


def train_params(wildcards):
    """What the trained weights depend on (snaketune.config.owners: the train keys of facet WEIGHTS); its hash names
    the checkpoint directory, so a changed setting never resumes a stale run, and a changed bookkeeping setting
    (checkpoint or logging cadence: resources) resumes it."""
    exp = experiment(wildcards)
    spec = {
        "model": owners.model_settings(exp.model),
        "train": train_settings(exp, "train", owners.WEIGHTS),
        "max_length": exp.tokenize.max_length,
        "data_key": keys.data_key(exp),
        "deepspeed_sha256": sha256_file(exp.train.deepspeed),
        "code": keys.code_hash("train"),
    }
    return {**spec, "run_key": keys.short_hash(spec)}


def checkpoints_dir(stage):
    """Where a stage's resumable checkpoints live (not outputs: they survive a failure)."""

    def directory(wildcards):
        root = Path("results/checkpoints", wildcards.experiment)
        return str(root if stage == "train" else root / stage)

    return directory


# ---- resources: where a stage runs and its bookkeeping (never compared by a rerun trigger) ---------------------


def stage_gpus(stage):
    """Snakemake's gpu counter; snakemake-executor-plugin-slurm turns it into --gpus, GPUs per JOB, so a job of
    several nodes asks through stage_gres (GPUs per node) instead and gets 0 here."""

    def gpus(wildcards):
        train = stage_train(experiment(wildcards), stage)
        return train.gpus if train.nodes == 1 else 0

    return gpus


def stage_nodes(stage):
    """Nodes of the stage's job (the SLURM plugin's --nodes); more than one needs SLURM."""

    def nodes(wildcards):
        return stage_train(experiment(wildcards), stage).nodes

    return nodes


def stage_gres(stage):
    """`gpu:N`, N per node, for a job of several nodes (SLURM's --gres); None (no such resource) for one."""

    def gres(wildcards):
        train = stage_train(experiment(wildcards), stage)
        return f"gpu:{train.gpus}" if train.nodes > 1 else None

    return gres


def stage_runtime(stage, key):
    """A runtime or record train key (checkpoint_every, keep_checkpoints, keep_final_checkpoint, log_every,
    eval_every) as a resource: it changes no output, so it must not rerun a finished stage nor rename its
    checkpoints (snaketune.config.owners); `--set-resources train:checkpoint_every=100` overrides it.
    """

    def value(wildcards):
        return owners.runtime_settings(stage_train(experiment(wildcards), stage))[key]

    return value


def runtime_resources(stage):
    """Every runtime and record train key of a stage as a resource (stage_runtime), and the GPU memory cap."""
    return {
        **{
            key: stage_runtime(stage, key)
            for key in owners.facet_keys([owners.RUNTIME, owners.RECORD])
        },
        "gpu_memory_mib": gpu_memory_mib(),
    }


def gpu_memory_mib():
    """gpu_memory_gib as a resource (MiB, 0 for none; snaketune.plan.budget.memory_cap_gib reads it back): the cap of
    each process's device memory, and the budget a stage plans its memory against when it starts.
    """
    return round(CFG.gpu_memory_gib * 1024) if CFG.gpu_memory_gib else 0


def train_threads(wildcards):
    """The experiment's share of the cores, as its GPUs are a share of those Snakemake may grant at once
    (--resources gpu=N; without it, all experiments' GPUs), so that experiments train side by side: with
    --cores 16 --resources gpu=4 a 2-GPU experiment gets 8, one that takes every GPU all 16. The ranks split
    them (snaketune.train.launch). One when there is no --cores: --report evaluates threads, and workflow.cores
    raises without it.
    """
    try:
        cores = workflow.cores
    except WorkflowError:
        return 1
    limit = getattr(workflow.global_resources.get("gpu"), "value", None)
    if limit is None:
        limit = sum(exp.train.gpus for exp in EXPERIMENTS.values())
    if limit < 1:
        return cores
    return max(1, cores * min(experiment(wildcards).train.gpus, limit) // limit)
