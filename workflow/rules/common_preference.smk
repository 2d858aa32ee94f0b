# Helpers of the preference rules (preference.smk) and of what evaluate and report read from them. Kept apart
# from the rules: snakemake --lint wants functions and rules in separate files.

PREFERENCE_EXPERIMENTS = {n: e for n, e in EXPERIMENTS.items() if e.preference.enabled}
PAIR_KEYS = {keys.pairs_key(e): e for e in PREFERENCE_EXPERIMENTS.values()}


def preference_enabled(exp):
    return exp.preference.enabled


def preferences_dir(exp):
    return f"results/data/preferences/{exp.preference.pairs}"


def pairs_dir(exp):
    return f"results/tokenized_pairs/{keys.pairs_key(exp)}"


def reference_dir(exp):
    """Named by the reference's run key: a reference whose settings or pairs changed is a missing file, which
    Snakemake always makes. Its params alone did not suffice: when plan_dpo (an ancient() input) reruns,
    Snakemake 9.27 checks the reference job no further, and a changed reference was not rerun.
    """
    return f"results/preference/{exp.name}/reference-{reference_params(None, exp)['run_key']}"


def reference_path(exp):
    return f"{reference_dir(exp)}/reference.parquet"


def dpo_dir(exp):
    return f"results/dpo/{exp.name}"


# ---- preferences / tokenize_pairs --------------------------------------------------------------------


def preferences_params(wildcards):
    ds = CFG.dataset
    return {
        "pairs": wildcards.pairs,
        "languages": list(ds.languages),
        "tree_states": list(ds.tree_states),
        "code": keys.code_hash("preferences"),
    }


def tokenize_pairs_input(wildcards):
    exp = PAIR_KEYS[wildcards.key]
    return {
        "train": f"{preferences_dir(exp)}/train.parquet",
        "validation": f"{preferences_dir(exp)}/validation.parquet",
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
    }


def tokenize_pairs_params(wildcards):
    exp = PAIR_KEYS[wildcards.key]
    return {
        "max_length": exp.preference.max_length,
        "chat_template": exp.tokenize.chat_template,
        "code": keys.code_hash("pairs"),
    }


# ---- reference / dpo ---------------------------------------------------------------------------------


def reference_input(wildcards):
    """What the reference pass starts from, as DPO does: the pairs, the model (the SFT model; the base is named by
    the params), the tokenizer, the DPO stage's DeepSpeed file and memory plan (the same ranks and strategy).
    """
    exp = experiment(wildcards)
    files = {
        "data": pairs_dir(exp),
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "deepspeed": exp.dpo_train.deepspeed,
        # The plan's memory cap and strategy (train.strategy auto), by its content: a plan_dpo rerun for a new
        # learning rate writes the same choice, and the params below hold what the choice depends on.
        "plan": ancient(plan_dpo_path(exp)),
    }
    if exp.preference.reference == "sft":
        files["policy"] = f"results/train/{exp.name}/model"
    else:
        files.update(base_model_input(exp.model))
    return files


# The train keys that cannot change a model's log-probabilities without training: the reference stage leaves them
# out of its params, so that a new learning rate or step count reruns DPO but reuses the reference.
REFERENCE_UNUSED_TRAIN = (
    "learning_rate",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "adam_betas",
    "grad_clip",
    "max_steps",
    "epochs",
    "global_batch_size",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "optimizer_kernel",
    "optimizer_states",
    "loss_kernel",
    "fused_cross_entropy",
)


def reference_params(wildcards, exp=None):
    """What the reference log-probabilities depend on: which model (the SFT model is an input; the base is named
    here), the DPO stage's model construction (LoRA and its quantization, kernels, attention, precision, ZeRO,
    micro-batch, seed) and the pairs (by their key). Not beta, nor the optimizer's or the schedule's settings.
    `exp` instead of wildcards: reference_dir names the outputs by this run key.
    """
    exp = exp or experiment(wildcards)
    train = {
        k: v
        for k, v in to_dict(exp.dpo_train).items()
        if k not in REFERENCE_UNUSED_TRAIN
    }
    spec = {
        "model": to_dict(exp.model),
        "train": train,
        "preference": {
            "reference": exp.preference.reference,
            "max_length": exp.preference.max_length,
        },
        "max_length": exp.preference.max_length,
        "pairs_key": keys.pairs_key(exp),
        "deepspeed_sha256": sha256_file(exp.dpo_train.deepspeed),
        "gpu_memory_gib": CFG.gpu_memory_gib,  # with train.strategy auto the plan's choice depends on it
        "code": keys.code_hash("reference"),
    }
    return {**spec, "run_key": keys.short_hash(spec)}


def dpo_input(wildcards):
    exp = experiment(wildcards)
    return {
        "data": pairs_dir(exp),
        "reference": reference_path(exp),
        "policy": f"results/train/{exp.name}/model",
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "deepspeed": exp.dpo_train.deepspeed,
        "plan": plan_dpo_path(exp),
    }


def dpo_params(wildcards):
    """Everything that changes the preference-tuned model; its hash names the checkpoint directory."""
    exp = experiment(wildcards)
    preference = {k: v for k, v in to_dict(exp.preference).items() if k != "train"}
    spec = {
        "model": to_dict(exp.model),
        "train": to_dict(exp.dpo_train),
        "preference": preference,
        "max_length": exp.preference.max_length,
        "pairs_key": keys.pairs_key(exp),
        "deepspeed_sha256": sha256_file(exp.dpo_train.deepspeed),
        "code": keys.code_hash("dpo"),
    }
    return {**spec, "run_key": keys.short_hash(spec)}


def dpo_gpus(wildcards):
    train = experiment(wildcards).dpo_train
    return train.gpus if train.nodes == 1 else 0


def dpo_nodes(wildcards):
    return experiment(wildcards).dpo_train.nodes


def dpo_gres(wildcards):
    train = experiment(wildcards).dpo_train
    return f"gpu:{train.gpus}" if train.nodes > 1 else None
