# Config validation and the helpers that the rule files use. Validation runs first, so a bad config stops
# the workflow before any job starts, with the key, the file that sets it and the allowed values in the message.

import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from snaketune import backups, hub, keys, provenance, verify  # noqa: E402
from snaketune.config import owners  # noqa: E402
from snaketune.config.choices import ConfigError  # noqa: E402
from snaketune.config.load import load_config, set_in, to_dict
from snaketune.config.paths import check_input_paths
from snaketune.data.format_config import resolve_format
from snaketune.io import sha256_file  # noqa: E402

# A failing job of a rule with update() outputs keeps them as they were, without copying them (snaketune.backups).
backups.install()


def config_layers():
    """What the config is made of, the later winning: the Snakefile's configfile, each --configfile, --config."""
    import yaml

    given = list(workflow.config_settings.configfiles)
    files = [
        Path(f) for f in workflow.configfiles if Path(f).absolute() not in given
    ] + given
    shown = [os.path.relpath(f) if Path(f).is_absolute() else str(f) for f in files]
    layers = [
        (name, yaml.safe_load(Path(f).read_text()) or {})
        for name, f in zip(shown, files)
    ]
    return [*layers, ("--config", dict(workflow.config_settings.config))]


# No Snakemake validate(config, schema): load_config checks every key as the dataclasses declare it, which is what
# workflow/schemas/config.schema.yaml is generated from (snaketune.config.generate), and the rules across keys that
# a schema cannot state, with one line naming the key; validate would refuse nothing more, and where the two ever
# differed it would print the whole schema.
try:
    CFG = load_config(config)
    # Local inputs that do not exist stop the workflow here, before any job (snaketune.config.paths says why).
    check_input_paths(CFG)
    # dataset.format auto told from the file's fields (snaketune.data.formats): every stage and key sees what it is.
    CFG = resolve_format(CFG)
    # Hub revisions pinned to commits once (snaketune.hub): what every stage loads and every key names.
    CFG = hub.pin_config(CFG, hub.Pins())
except ConfigError as e:
    source = set_in(e.key, config_layers())
    raise WorkflowError(
        f"Invalid configuration: {e}" + (f" (set in {source})" if source else "")
    ) from None
EXPERIMENTS = CFG.experiments
# Several experiments may share one tokenized cache (same data, tokenizer and settings).
DATA_KEYS = {keys.data_key(exp): exp for exp in EXPERIMENTS.values()}
TOKENIZERS = {keys.tokenizer_id(exp.model): exp.model for exp in EXPERIMENTS.values()}


def all_targets():
    """The report (it depends on every experiment's training and evaluation, and on the data stages), the memory
    plans (the preflight checks, which no stage reads) and, under benchmark.fail_on_drop, the check that fails the
    run on a drop the report flags (rule benchmark_gate)."""
    return [
        "results/report/index.html",
        "results/report/report.md",
        "results/report/summary.json",
        *plan_targets(),
        *(["results/report/gate.json"] if CFG.benchmark.fail_on_drop else []),
    ]


def preflight():
    """Cached outputs of the current config's jobs checked against their records before any job runs
    (snaketune.verify): a changed one stops the workflow with the command that rebuilds it; the missing ones are
    returned, for rule all to ask for (Snakemake alone would not rebuild an output whose consumers are up to date).
    In the main process only: a job that Snakemake runs elsewhere (SLURM) reads this file again.
    """
    if not workflow.is_main_process:
        return []
    try:
        return verify.preflight(
            provenance.load_records(),
            workflow_outputs(),
            lambda path: any(rule.is_producer(path) for rule in workflow.rules),
        )
    except verify.OutputsChanged as e:
        raise WorkflowError(str(e)) from None


def all_cores(wildcards=None):
    """Every core Snakemake may use (--cores): the CPU stages that run alone on their machine's CPU (export,
    the GGUF files' benchmark jobs: llama.cpp and transformers on the CPU). A runtime setting, not a config key:
    `--set-threads export=4` lowers it. One when there is no --cores (--report evaluates threads).
    """
    try:
        return workflow.cores
    except WorkflowError:
        return 1


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
    """The source and what that source reads (keys.source_identity: a file by its content, a hub dataset by its
    commit, the builtin sample by its generator's settings)."""
    ds = CFG.dataset
    return {
        "source": ds.source,
        **keys.source_identity(ds),
        "format": ds.format,
        "code": keys.code_hash("download"),
    }


def download_input():
    """A local source file is an input, so editing it reruns the workflow; builtin and hub have none."""
    src = CFG.dataset.source
    return [] if src == "builtin" or src.startswith("hub:") else [src]


def conversations_params():
    """paths and tree_states only for oasst-format data: chat-format conversations have no trees."""
    ds = CFG.dataset
    oasst = {"paths": ds.paths, "tree_states": list(ds.tree_states)}
    return {
        "languages": list(ds.languages),
        **(oasst if ds.format == "oasst" else {}),
        "validation_fraction": ds.validation_fraction,
        "max_trees": ds.max_trees,
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
    return {
        "name": model.tokenizer_name,
        "revision": model.tokenizer_hub_revision,
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
