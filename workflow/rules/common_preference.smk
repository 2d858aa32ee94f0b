# Helpers of the preference rules (preference.smk) and of what evaluate and report read from them. Kept apart
# from the rules: snakemake --lint wants functions and rules in separate files.

PREFERENCE_EXPERIMENTS = {n: e for n, e in EXPERIMENTS.items() if e.preference.enabled}
PAIR_KEYS = {keys.pairs_key(e): e for e in PREFERENCE_EXPERIMENTS.values()}
# results/data/preferences/<name>: the pairing of the dataset's ranks, or a pairs file by its content.
PAIR_NAMES = {keys.pairs_name(e): e for e in PREFERENCE_EXPERIMENTS.values()}


def preference_enabled(exp):
    return exp.preference.enabled


def preferences_dir(exp):
    return f"results/data/preferences/{keys.pairs_name(exp)}"


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


def preferences_input(wildcards):
    """A pairs file (preference.source), or the dataset's messages and the conversations' split."""
    exp = PAIR_NAMES[wildcards.pairs]
    if exp.preference.from_file:
        return {"pairs": exp.preference.source}
    return {
        "messages": rules.download.output.messages,
        "train": rules.conversations.output.train,
        "validation": rules.conversations.output.validation,
    }


def preferences_params(wildcards):
    """A pairs file: its content and the split's fraction (a hash of each prompt); the dataset's ranks: the pairing
    and the filters of the trees."""
    exp = PAIR_NAMES[wildcards.pairs]
    ds = CFG.dataset
    if exp.preference.from_file:
        return {
            "pairs_file": keys.pairs_file_identity(exp.preference),
            "validation_fraction": ds.validation_fraction,
            "code": keys.code_hash("preferences"),
        }
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
    }
    if exp.preference.reference == "sft":
        files["policy"] = f"results/train/{exp.name}/model"
    else:
        files.update(base_model_input(exp.model))
    return files


def reference_params(wildcards, exp=None):
    """What the reference log-probabilities depend on (snaketune.config.owners: the preference stage's train keys of
    facet LOGPROBS: how the model is built and computes, its seed), which model (the SFT model is an input; the base
    is named here) and the pairs (by their key). Not beta, nor the optimizer's or the schedule's settings.
    `exp` instead of wildcards: reference_dir names the outputs by this run key.
    """
    exp = exp or experiment(wildcards)
    spec = {
        "model": owners.model_settings(exp.model),
        "train": train_settings(exp, "reference", owners.LOGPROBS),
        "preference": {
            "reference": exp.preference.reference,
            "max_length": exp.preference.max_length,
        },
        "max_length": exp.preference.max_length,
        "pairs_key": keys.pairs_key(exp),
        "deepspeed_sha256": sha256_file(exp.dpo_train.deepspeed),
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
    }


def dpo_params(wildcards):
    """What the preference-tuned weights depend on (the preference stage's train keys of facet WEIGHTS, the
    preference keys); its hash names the checkpoint directory."""
    exp = experiment(wildcards)
    preference = {k: v for k, v in to_dict(exp.preference).items() if k != "train"}
    spec = {
        "model": owners.model_settings(exp.model),
        "train": train_settings(exp, "dpo", owners.WEIGHTS),
        "preference": preference,
        "max_length": exp.preference.max_length,
        "pairs_key": keys.pairs_key(exp),
        "deepspeed_sha256": sha256_file(exp.dpo_train.deepspeed),
        "code": keys.code_hash("dpo"),
    }
    return {**spec, "run_key": keys.short_hash(spec)}
