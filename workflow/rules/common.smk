# Config validation and the helpers that the rule files use. Validation runs first, so a bad config stops
# the workflow before any job starts, with the key and the allowed values in the message.

import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from snaketune import keys  # noqa: E402
from snaketune.config.choices import ConfigError  # noqa: E402
from snaketune.config.load import load_config, to_dict
from snaketune.io import sha256_file  # noqa: E402

try:
    CFG = load_config(config)
except ConfigError as e:
    raise WorkflowError(f"Invalid configuration: {e}") from None
# Defaults live in the typed config (snaketune.config.schema), not in the schema.
validate(config, schema="../schemas/config.schema.yaml", set_default=False)

EXPERIMENTS = CFG.experiments
# Several experiments may share one tokenized cache (same data, tokenizer and settings).
DATA_KEYS = {keys.data_key(exp): exp for exp in EXPERIMENTS.values()}
TOKENIZERS = {keys.tokenizer_id(exp.model): exp.model for exp in EXPERIMENTS.values()}


def all_targets():
    """The report: it depends on every experiment's training and evaluation, and on the data stages."""
    return [
        "results/report/index.html",
        "results/report/report.md",
        "results/report/summary.json",
    ]


def experiment(wildcards):
    return EXPERIMENTS[wildcards.experiment]


def exp_for_key(wildcards):
    return DATA_KEYS[wildcards.key]


# ---- models from GGUF files --------------------------------------------------------------------------


# The hub-format directory of each GGUF file an experiment's model.base names (rule import_gguf makes it).
GGUF_MODELS = {
    Path(exp.model.pretrained).name: exp.model.base
    for exp in EXPERIMENTS.values()
    if exp.model.is_gguf
}


def gguf_input(wildcards):
    return GGUF_MODELS[wildcards.gguf]


def import_gguf_params(wildcards):
    """model.trust_remote_code of the experiments that name the file (all of them, or the import is refused)."""
    trusted = {
        e.model.trust_remote_code
        for e in EXPERIMENTS.values()
        if e.model.base == GGUF_MODELS[wildcards.gguf]
    }
    return {"trust_remote_code": all(trusted), "code": keys.code_hash("import_gguf")}


def base_model_input(model):
    """The imported directory of a GGUF model, as an input of every stage that reads the model (none for other
    models: a hub id or a directory the user brings is not made by the workflow)."""
    return {"base_model": model.pretrained} if model.is_gguf else {}


# ---- download / conversations ------------------------------------------------------------------


def download_params():
    ds = CFG.dataset
    return {
        "source": ds.source,
        "builtin_trees": ds.builtin_trees,
        "builtin_seed": ds.builtin_seed,
        "code": keys.code_hash("download"),
    }


def download_input():
    """A local source file is an input, so editing it reruns the workflow; builtin and hub have none."""
    src = CFG.dataset.source
    return [] if src == "builtin" or src.startswith("hub:") else [src]


def conversations_params():
    ds = CFG.dataset
    return {
        "languages": list(ds.languages),
        "paths": ds.paths,
        "validation_fraction": ds.validation_fraction,
        "tree_states": list(ds.tree_states),
        "code": keys.code_hash("conversations"),
    }


# ---- tokenizer / tokenize ------------------------------------------------------------------------


def tokenizer_dir(exp):
    return f"results/tokenizer/{keys.tokenizer_id(exp.model)}"


def fetch_tokenizer_input(wildcards):
    model = TOKENIZERS[wildcards.tokenizer]
    return base_model_input(model) if model.tokenizer == "auto" else {}


def fetch_tokenizer_params(wildcards):
    model = TOKENIZERS[wildcards.tokenizer]
    name = model.pretrained if model.tokenizer == "auto" else model.tokenizer
    return {
        "name": name,
        "revision": model.revision,
        "trust_remote_code": model.trust_remote_code,
        "code": keys.code_hash("tokenizer"),
    }


def tokenize_input(wildcards):
    exp = exp_for_key(wildcards)
    return {
        "train": "results/data/conversations/train.parquet",
        "validation": "results/data/conversations/validation.parquet",
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
    }


def tokenize_params(wildcards):
    exp = exp_for_key(wildcards)
    return {**keys.tokenize_settings(exp.tokenize), "code": keys.code_hash("tokenize")}


def tokenized_dir(exp):
    return f"results/tokenized/{keys.data_key(exp)}"


# ---- train ---------------------------------------------------------------------------------------


def train_input(wildcards):
    exp = experiment(wildcards)
    return {
        "data": tokenized_dir(exp),
        "tokenizer": f"{tokenizer_dir(exp)}/tokenizer.json",
        "deepspeed": exp.train.deepspeed,
        "plan": plan_path(exp),
        **base_model_input(exp.model),
    }


def train_params(wildcards):
    """Everything that changes the trained model; its hash names the checkpoint directory, so a changed
    setting never resumes a stale run."""
    exp = experiment(wildcards)
    spec = {
        "model": to_dict(exp.model),
        "train": to_dict(exp.train),
        "max_length": exp.tokenize.max_length,
        "data_key": keys.data_key(exp),
        "deepspeed_sha256": sha256_file(exp.train.deepspeed),
        "code": keys.code_hash("train"),
    }
    return {**spec, "run_key": keys.short_hash(spec)}


def train_gpus(wildcards):
    """Snakemake's gpu counter; snakemake-executor-plugin-slurm turns it into --gpus, GPUs per JOB, so a
    job of several nodes asks through train_gres (GPUs per node) instead and gets 0 here.
    """
    train = experiment(wildcards).train
    return train.gpus if train.nodes == 1 else 0


def train_nodes(wildcards):
    """Nodes of the train job (the SLURM plugin's --nodes); more than one needs SLURM."""
    return experiment(wildcards).train.nodes


def train_gres(wildcards):
    """`gpu:N`, N per node, for a job of several nodes (SLURM's --gres); None (no such resource) for one."""
    train = experiment(wildcards).train
    return f"gpu:{train.gpus}" if train.nodes > 1 else None


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
