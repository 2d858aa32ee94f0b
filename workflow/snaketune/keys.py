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

from snaketune.config.load import to_dict
from snaketune.config.schema import DatasetConfig, ExperimentConfig, ModelConfig, TokenizeConfig
from snaketune.io import stable_json

# Where each stage starts running package code. code_hash() follows the `snaketune` imports of these modules
# (snakemake#2192: Snakemake itself does not see edits to modules a script imports), so a module a stage
# starts to import is covered without an edit here. snaketune.train.trainer is named because snaketune.train.launch
# starts it in the ranks with `python -m`, which is not an import. snaketune.io is named for the tokenizer
# stage because its scripts write the tokenizer through io's atomic writers, which snaketune.data.tokenizer does
# not import. tests/test_keys.py checks that every script's imports fall inside its stage and that the
# import scan agrees with Python's own parser.
STAGE_MODULES = {
    "import_gguf": ("snaketune.model.gguf",),
    "download": ("snaketune.data.download",),
    "conversations": ("snaketune.data.conversations",),
    "tokenizer": ("snaketune.data.tokenizer", "snaketune.io"),
    "tokenize": ("snaketune.data.tokenization",),
    "plan": ("snaketune.plan.search",),
    "train": ("snaketune.train.launch", "snaketune.train.trainer"),
    "preferences": ("snaketune.data.preferences", "snaketune.data.readers"),
    "pairs": ("snaketune.data.pairs",),
    "reference": ("snaketune.train.launch", "snaketune.preference.reference"),
    "dpo": ("snaketune.train.launch", "snaketune.preference.dpo"),
    "evaluate": ("snaketune.evaluation.evaluate", "snaketune.gpus"),
    "export": ("snaketune.export.export", "snaketune.data.prompts"),
    "benchmark": ("snaketune.benchmark.run", "snaketune.gpus"),
    "report": ("snaketune.report.build",),
    "manifest": ("snaketune.provenance",),
}

PACKAGE_DIR = Path(__file__).resolve().parent
# `from snaketune[.pkg][.mod] import names` and `import snaketune.pkg.mod`, anywhere in a line's indentation
# (imports inside functions run too). A regex, not ast: parsing every module costs ~0.1 s, and this runs
# whenever Snakemake builds the DAG.
_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+snaketune((?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
    r"|import[ \t]+([^\n]*\bsnaketune\.[^\n]*))",
    re.MULTILINE,
)


def _short(text: str, n: int = 12) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def module_path(module: str) -> Path | None:
    """The file of a snaketune module (`snaketune.data.messages` -> data/messages.py); a subpackage's
    __init__.py for a package; None when there is none."""
    if not module.startswith("snaketune."):
        return None
    rel = Path(*module.split(".")[1:])
    path = PACKAGE_DIR / rel.with_suffix(".py")
    if path.is_file():
        return path
    init = PACKAGE_DIR / rel / "__init__.py"
    return init if init.is_file() else None


def is_package(module: str) -> bool:
    path = module_path(module)
    return path is not None and path.name == "__init__.py"


@cache
def _source(module: str) -> bytes:
    path = module_path(module)
    if path is None:
        raise ModuleNotFoundError(module)
    return path.read_bytes()


def _names(clause: str) -> list[str]:
    """`a, b as c` or `(a,\n b)` -> [a, b] (comments and parentheses dropped)."""
    clause = re.sub(r"#[^\n]*", "", clause).strip("()")
    return [part.split()[0] for part in clause.split(",") if part.strip()]


@cache
def imported_modules(module: str) -> frozenset[str]:
    """The snaketune modules that `module`'s source imports. Packages' __init__.py files are empty
    (tests/test_layout.py), so a package itself is not counted: `from snaketune.data import messages`
    counts snaketune.data.messages, `from snaketune.data.messages import x` the same module."""
    found = set()
    for sub, names, plain in _IMPORT.findall(_source(module).decode("utf-8")):
        if plain:
            found.update(n for n in _names(plain) if n.startswith("snaketune."))
            continue
        parent = f"snaketune{sub}"
        if is_package(parent) or parent == "snaketune":
            found.update(f"{parent}.{n}" for n in _names(names) if module_path(f"{parent}.{n}"))
        else:
            found.add(parent)
    return frozenset(m for m in found - {module} if not is_package(m))


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
    name = model.pretrained if model.tokenizer == "auto" else model.tokenizer
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
