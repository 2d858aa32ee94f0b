"""Names of cached outputs, derived from everything that changes them.

The tokenized cache lives at `results/tokenized/<data_key>/`, where the key hashes the dataset settings,
the tokenizer's identity, the chat template, every tokenize setting and the source of the modules that
produce the data. A changed template or tokenizer therefore lands in a new directory and can never reuse
a stale cache (Axolotl #1265). The key must be known when Snakemake builds the DAG, so it hashes the
*specification* of the inputs; the content hashes of the actual files are recorded in the cache's
stats.json and checked again by the training stage before it trusts the data.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from functools import cache
from pathlib import Path

from snaketune.config.load import to_dict
from snaketune.config.preference import PreferenceConfig
from snaketune.config.schema import DatasetConfig, ExperimentConfig, ModelConfig, TokenizeConfig
from snaketune.io import sha256_file, stable_json

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
    "preferences": ("snaketune.data.preferences", "snaketune.data.readers", "snaketune.data.pair_format"),
    "pairs": ("snaketune.data.pairs",),
    "reference": ("snaketune.train.launch", "snaketune.preference.reference"),
    "dpo": ("snaketune.train.launch", "snaketune.preference.dpo"),
    "evaluate": ("snaketune.evaluation.evaluate", "snaketune.gpus", "snaketune.plan.search"),
    "export": ("snaketune.export.export", "snaketune.data.prompts"),
    "benchmark": ("snaketune.benchmark.run", "snaketune.gpus"),
    "report": ("snaketune.report.build",),
    "benchmark_gate": ("snaketune.report.gate",),
    "manifest": ("snaketune.provenance",),
    "verify": ("snaketune.verify", "snaketune.provenance"),
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


class _DropDocstrings(ast.NodeTransformer):
    """Removes every statement that is a bare string (docstrings, and the attribute docstrings under dataclass
    fields): Python evaluates them and throws them away. Nothing in the package reads `__doc__`
    (tests/test_keys.py checks), so they cannot change an output."""

    def visit(self, node):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [
                s
                for s in body
                if not (
                    isinstance(s, ast.Expr)
                    and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, str)
                )
            ]
            node.body = kept or [ast.Pass()]
        return self.generic_visit(node)


def meaning_hash(source: bytes) -> str:
    """Hash of what Python source does: its syntax tree without docstrings, comments, formatting or line numbers."""
    tree = _DropDocstrings().visit(ast.parse(source))
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()


MEANING_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "snaketune" / "code-meaning.json"
)
"""sha256 of a module's bytes -> its meaning_hash: parsing the ~70 modules a DAG hashes costs 0.3-0.7 s, which every
dry run would pay again. Content-addressed, so any checkout and any concurrent writer agree; unwritable: not kept."""


@cache
def _meanings() -> dict[str, str]:
    try:
        return json.loads(MEANING_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _remember(meanings: dict[str, str]) -> None:
    try:
        MEANING_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = MEANING_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meanings))
        tmp.replace(MEANING_CACHE)
    except OSError:
        pass


@cache
def module_source_hash(module: str) -> str:
    """Hash of what a module does (`meaning_hash`): a change that cannot alter an output (a reworded docstring, a
    comment, reformatting) keeps it; any change of code changes it."""
    source = _source(module)
    meanings = _meanings()
    raw = hashlib.sha256(source).hexdigest()
    if raw not in meanings:
        meanings[raw] = meaning_hash(source)
        _remember(meanings)
    return meanings[raw]


def code_hash(stage: str) -> str:
    """Hash of what every module a stage runs does (`module_source_hash`), so that editing a module a stage
    imports reruns it (snakemake#2192) unless the edit is a comment, a docstring or formatting."""
    return _short("".join(f"{m}:{module_source_hash(m)}\n" for m in stage_modules(stage)), 16)


def tokenizer_id(model: ModelConfig) -> str:
    """Directory name under results/tokenizer/ for the experiment's tokenizer."""
    if model.uses_builtin_tokenizer:
        return "builtin"
    name = model.tokenizer_name
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[-40:]
    return f"{slug}-{_short(stable_json([name, model.tokenizer_hub_revision, model.trust_remote_code]), 8)}"


@cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def source_digest(path: str) -> str:
    """sha256 of a local dataset file, hashed once per file version (size and mtime) per process."""
    st = Path(path).stat()
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def source_identity(dataset: DatasetConfig) -> dict:
    """What the downloaded data is, as far as the settings can tell when Snakemake builds the DAG: a local file by
    its content (a renamed file is the same data; an edited one is not), a hub dataset by its commit (snaketune.hub
    pins it), the builtin sample by its generator's settings. Only the keys that source reads: a builtin setting
    does not change a file's data."""
    src = dataset.source
    if src == "builtin":
        return {"builtin": {"trees": dataset.builtin_trees, "seed": dataset.builtin_seed}}
    if src.startswith("hub:"):
        return {"hub": src.removeprefix("hub:"), "revision": dataset.revision}
    return {"file_sha256": source_digest(src), "suffix": "".join(Path(src).suffixes[-2:])}


def dataset_spec(dataset: DatasetConfig) -> dict:
    """The dataset's part of a data cache key: what the data is, the format it is read as (resolved from `auto` when
    the config loads: snaketune.data.formats) and how conversations are made of it (paths and tree_states are oasst's:
    chat-format data does not read them)."""
    skip = {"source", "revision", "builtin_trees", "builtin_seed"}
    if dataset.format == "chat":
        skip |= {"paths", "tree_states"}
    if dataset.max_trees is None:  # the key came later: the data keys made before it stay as they were
        skip.add("max_trees")
    rest = {k: v for k, v in to_dict(dataset).items() if k not in skip}
    return {**source_identity(dataset), **rest}


def pairs_file_identity(preference: PreferenceConfig) -> dict:
    """A pairs file (preference.source) by its content, as source_identity names a dataset file."""
    return {
        "file_sha256": source_digest(preference.source),
        "suffix": "".join(Path(preference.source).suffixes[-2:]),
    }


def pairs_name(exp: ExperimentConfig) -> str:
    """The directory under results/data/preferences/ of an experiment's pairs: the pairing of the dataset's ranked
    replies (preference.pairs), or `file-` and 12 hex digits of a pairs file's sha256."""
    if exp.preference.from_file:
        return f"file-{pairs_file_identity(exp.preference)['file_sha256'][:12]}"
    return exp.preference.pairs


def data_key(exp: ExperimentConfig) -> str:
    """Cache key of the tokenized data of one experiment."""
    spec = {
        "dataset": dataset_spec(exp.dataset),
        "tokenizer": tokenizer_id(exp.model),
        "tokenize": to_dict(exp.tokenize),
        "code": [code_hash(s) for s in ("download", "conversations", "tokenizer", "tokenize")],
    }
    return _short(stable_json(spec), 16)


def pairs_key(exp: ExperimentConfig) -> str:
    """Cache key of the tokenized preference pairs of one experiment: the dataset and the pairing (or the pairs file
    and the split's fraction), the tokenizer, the chat template, the tokens per side and the code of every stage that
    makes them."""
    if exp.preference.from_file:  # the file's pairs, split by the hash of each prompt
        source = {
            "pairs_file": pairs_file_identity(exp.preference),
            "validation_fraction": exp.dataset.validation_fraction,
        }
        stages = ("preferences", "tokenizer", "pairs")
    else:
        source = {"dataset": dataset_spec(exp.dataset), "pairs": exp.preference.pairs}
        stages = ("download", "conversations", "preferences", "tokenizer", "pairs")
    spec = {
        **source,
        "max_length": exp.preference.max_length,
        "tokenizer": tokenizer_id(exp.model),
        "chat_template": exp.tokenize.chat_template,
        "code": [code_hash(s) for s in stages],
    }
    return _short(stable_json(spec), 16)


def tokenize_settings(tok: TokenizeConfig) -> dict:
    return to_dict(tok)


def short_hash(obj) -> str:
    return _short(stable_json(obj), 16)
