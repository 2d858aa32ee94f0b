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


def reference_path(exp):
    return f"results/preference/{exp.name}/reference.parquet"


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
    exp = experiment(wildcards)
    files = {
        "pairs": pairs_dir(exp),
        "summary": f"results/train/{exp.name}/summary.json",
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "plan": plan_path(exp),
    }
    if exp.preference.reference == "sft":
        files["model"] = f"results/train/{exp.name}/model"
    return files


def reference_params(wildcards):
    """What the reference log-probabilities depend on: the reference model (an input when it is the SFT
    model; named by model, seed and precision when it is the base) and the pairs (an input). Not beta.
    """
    exp = experiment(wildcards)
    return {
        "model": to_dict(exp.model),
        "reference": exp.preference.reference,
        "seed": exp.train.seed,
        "batch_size": exp.dpo_train.micro_batch_size,
        "code": keys.code_hash("reference"),
    }


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
