"""Names of cached outputs, derived from everything that changes them.

The tokenized cache lives at `results/tokenized/<data_key>/`, where the key hashes the dataset settings,
the tokenizer's identity, the chat template, every tokenize setting and the source of the modules that
produce the data. A changed template or tokenizer therefore lands in a new directory and can never reuse
a stale cache (Axolotl #1265). The key must be known when Snakemake builds the DAG, so it hashes the
*specification* of the inputs; the content hashes of the actual files are recorded in the cache's
stats.json and checked again by the training stage before it trusts the data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from functools import cache

from snaketune.config import DatasetConfig, ExperimentConfig, ModelConfig, TokenizeConfig, to_dict
from snaketune.io import stable_json

# Modules whose source decides each stage's output; an edit reruns that stage (snakemake#2192 means
# Snakemake itself does not see edits to modules a script imports).
STAGE_MODULES = {
    "download": ("snaketune.download", "snaketune.builtin_data", "snaketune.conversations", "snaketune.io"),
    "conversations": ("snaketune.conversations", "snaketune.io"),
    "tokenizer": ("snaketune.tokenizer", "snaketune.conversations", "snaketune.io"),
    "tokenize": ("snaketune.tokenization", "snaketune.tokenizer", "snaketune.io"),
    "train": (
        "snaketune.training",
        "snaketune.batching",
        "snaketune.dsconfig",
        "snaketune.model",
        "snaketune.metrics",
        "snaketune.checkpoint",
        "snaketune.launch",
        "snaketune.io",
    ),
    "evaluate": (
        "snaketune.evaluate",
        "snaketune.batching",
        "snaketune.model",
        "snaketune.tokenization",
        "snaketune.builtin_data",
        "snaketune.io",
    ),
    "report": (
        "snaketune.report",
        "snaketune.report_sections",
        "snaketune.report_render",
        "snaketune.report_plots",
        "snaketune.io",
    ),
}


def _short(text: str, n: int = 12) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


@cache
def module_source_hash(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    with open(spec.origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def code_hash(stage: str) -> str:
    """Hash of the source of the modules that a stage runs."""
    modules = STAGE_MODULES[stage]
    return _short("".join(f"{m}:{module_source_hash(m)}\n" for m in sorted(modules)), 16)


def tokenizer_id(model: ModelConfig) -> str:
    """Directory name under results/tokenizer/ for the experiment's tokenizer."""
    if model.uses_builtin_tokenizer:
        return "builtin"
    name = model.base if model.tokenizer == "auto" else model.tokenizer
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[-40:]
    return f"{slug}-{_short(stable_json([name, model.revision, model.trust_remote_code]), 8)}"


def dataset_spec(dataset: DatasetConfig) -> dict:
    return to_dict(dataset)


def data_key(exp: ExperimentConfig) -> str:
    """Cache key of the tokenized data of one experiment."""
    spec = {
        "dataset": dataset_spec(exp.dataset),
        "tokenizer": tokenizer_id(exp.model),
        "tokenizer_spec": [exp.model.base, exp.model.tokenizer, exp.model.revision],
        "tokenize": to_dict(exp.tokenize),
        "code": [code_hash(s) for s in ("download", "conversations", "tokenizer", "tokenize")],
    }
    return _short(stable_json(spec), 16)


def tokenize_settings(tok: TokenizeConfig) -> dict:
    return to_dict(tok)


def short_hash(obj) -> str:
    return _short(stable_json(obj), 16)


def file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
