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
import re
from functools import cache
from pathlib import Path

from snaketune.config import DatasetConfig, ExperimentConfig, ModelConfig, TokenizeConfig, to_dict
from snaketune.io import stable_json

# Where each stage starts running package code. code_hash() follows the `snaketune` imports of these modules
# (snakemake#2192: Snakemake itself does not see edits to modules a script imports), so a module a stage
# starts to import is covered without an edit here. snaketune.training is named because snaketune.launch
# starts it in the ranks with `python -m`, which is not an import. snaketune.io is named for the tokenizer
# stage because its scripts write the tokenizer through io's atomic writers, which snaketune.tokenizer does
# not import. tests/test_keys.py checks that every script's imports fall inside its stage and that the
# import scan agrees with Python's own parser.
STAGE_MODULES = {
    "download": ("snaketune.download",),
    "conversations": ("snaketune.conversations",),
    "tokenizer": ("snaketune.tokenizer", "snaketune.io"),
    "tokenize": ("snaketune.tokenization",),
    "plan": ("snaketune.plan",),
    "train": ("snaketune.launch", "snaketune.training"),
    "preferences": ("snaketune.preferences",),
    "pairs": ("snaketune.pairs",),
    "reference": ("snaketune.reference",),
    "dpo": ("snaketune.launch", "snaketune.dpo"),
    "evaluate": ("snaketune.evaluate",),
    "report": ("snaketune.report",),
    "manifest": ("snaketune.provenance",),
}

PACKAGE_DIR = Path(__file__).resolve().parent
# `from snaketune[.mod] import names` and `import snaketune.mod`, anywhere in a line's indentation (imports
# inside functions run too). A regex, not ast: parsing every module costs ~0.1 s, and this runs whenever
# Snakemake builds the DAG.
_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+snaketune(?:\.(\w+))?[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
    r"|import[ \t]+([^\n]*\bsnaketune\.[^\n]*))",
    re.MULTILINE,
)


def _short(text: str, n: int = 12) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


@cache
def _source(module: str) -> bytes:
    path = PACKAGE_DIR / f"{module.removeprefix('snaketune.')}.py"
    if not module.startswith("snaketune.") or not path.is_file():
        raise ModuleNotFoundError(module)
    return path.read_bytes()


def _names(clause: str) -> list[str]:
    """`a, b as c` or `(a,\n b)` -> [a, b] (comments and parentheses dropped)."""
    clause = re.sub(r"#[^\n]*", "", clause).strip("()")
    return [part.split()[0] for part in clause.split(",") if part.strip()]


@cache
def imported_modules(module: str) -> frozenset[str]:
    """The snaketune modules that `module`'s source imports (the package's __init__, which holds only the
    version string, is not counted)."""
    found = set()
    for sub, names, plain in _IMPORT.findall(_source(module).decode("utf-8")):
        if plain:
            found.update(n for n in _names(plain) if n.startswith("snaketune."))
        elif sub:
            found.add(f"snaketune.{sub}")
        else:  # from snaketune import a, b: the names that are modules
            found.update(f"snaketune.{n}" for n in _names(names) if (PACKAGE_DIR / f"{n}.py").is_file())
    return frozenset(found - {module})


@cache
def stage_modules(stage: str) -> tuple[str, ...]:
    """Every snaketune module a stage runs: its entry modules and all they import, transitively."""
    seen: set[str] = set()
    todo = list(STAGE_MODULES[stage])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imported_modules(module))
    return tuple(sorted(seen))


def module_source_hash(module: str) -> str:
    return hashlib.sha256(_source(module)).hexdigest()


def code_hash(stage: str) -> str:
    """Hash of the source of every module a stage runs (byte for byte: a comment edit counts too)."""
    return _short("".join(f"{m}:{module_source_hash(m)}\n" for m in stage_modules(stage)), 16)


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


def pairs_key(exp: ExperimentConfig) -> str:
    """Cache key of the tokenized preference pairs of one experiment: the dataset, the pairing, the tokenizer,
    the chat template, the tokens per side and the code of every stage that makes them."""
    spec = {
        "dataset": dataset_spec(exp.dataset),
        "pairs": exp.preference.pairs,
        "max_length": exp.preference.max_length,
        "tokenizer": tokenizer_id(exp.model),
        "tokenizer_spec": [exp.model.base, exp.model.tokenizer, exp.model.revision],
        "chat_template": exp.tokenize.chat_template,
        "code": [code_hash(s) for s in ("download", "conversations", "preferences", "tokenizer", "pairs")],
    }
    return _short(stable_json(spec), 16)


def tokenize_settings(tok: TokenizeConfig) -> dict:
    return to_dict(tok)


def short_hash(obj) -> str:
    return _short(stable_json(obj), 16)
