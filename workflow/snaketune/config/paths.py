"""The config's local inputs checked before any job: a file or directory that does not exist, or is not what the
key takes, stops the workflow when Snakemake builds the DAG, with the key, the path and what is allowed.

Snakemake alone does not: it skips a job whose input is missing when that job's outputs exist and runs the rest
of the DAG, so a dataset.source that does not exist would leave the previous data in place under a new cache key;
in a fresh directory it stops with a generic MissingInputException that names no key.
"""

from __future__ import annotations

from pathlib import Path

from snaketune.config.choices import BUILTIN_MODELS, HUB_ID, SOURCE_SUFFIXES, fail
from snaketune.config.schema import Config, ModelConfig


def _where(path: str, workdir: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else workdir / p)


def _is_path(name: str) -> bool:
    """A name that can only be a local path: absolute, explicitly relative or home-relative, or not of the hub's
    owner/name form."""
    return name.startswith(("/", "./", "../", "~")) or not HUB_ID.match(name)


def check_dataset_source(source: str, workdir: Path) -> None:
    if source == "builtin" or source.startswith("hub:"):
        return
    p = Path(_where(source, workdir))
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        fail(
            "dataset.source",
            f"{source!r} {what} ({p}); allowed: builtin | hub:<owner>/<name> | an existing file ending in "
            f"{', '.join(SOURCE_SUFFIXES)}",
        )


def check_pairs_source(key: str, source: str, workdir: Path) -> None:
    """preference.source naming a pairs file: it exists."""
    p = Path(_where(source, workdir))
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        fail(
            key,
            f"{source!r} {what} ({p}); allowed: dataset | an existing pairs file ending in "
            f"{', '.join(SOURCE_SUFFIXES)} (prompt, chosen, rejected)",
        )


def check_model_dir(key: str, name: str, needs: tuple[str, ...], workdir: Path) -> None:
    """A model or tokenizer named by a local directory: it exists and holds one of `needs`. A hub id is checked by
    snaketune.hub when its revision is pinned."""
    p = Path(_where(name, workdir))
    if p.is_dir():
        if not any((p / f).is_file() for f in needs):
            fail(
                key,
                f"{name!r} is a directory without {' or '.join(needs)} ({p}); allowed: a hub-format directory",
            )
        return
    if p.exists() or _is_path(name):
        what = "is a file, not a directory" if p.exists() else "does not exist"
        fail(
            key,
            f"{name!r} {what} ({p}); allowed: a hub-format directory that exists, a hub id (<owner>/<name>)"
            + (", builtin-tiny, arch:deepseek-llm-7b or a .gguf file" if key.endswith("base") else ""),
        )


def check_model(where: str, model: ModelConfig, workdir: Path) -> None:
    if model.base not in BUILTIN_MODELS and not model.is_gguf:
        check_model_dir(f"{where}model.base", model.base, ("config.json",), workdir)
    if model.tokenizer != "auto":
        check_model_dir(
            f"{where}model.tokenizer", model.tokenizer, ("tokenizer.json", "tokenizer_config.json"), workdir
        )


def check_input_paths(cfg: Config, workdir: str | Path = ".") -> None:
    """Every local path the config names exists and is what its key takes (ConfigError otherwise)."""
    workdir = Path(workdir).resolve()
    check_dataset_source(cfg.dataset.source, workdir)
    for name, exp in cfg.experiments.items():
        where = f"experiments.{name}." if len(cfg.experiments) > 1 else ""
        check_model(where, exp.model, workdir)
        if exp.preference.enabled and exp.preference.from_file:
            check_pairs_source(f"{where}preference.source", exp.preference.source, workdir)
        for train, key in ((exp.train, "train.deepspeed"), (exp.dpo_train, "preference.train.deepspeed")):
            if train is not None and not Path(_where(train.deepspeed, workdir)).is_file():
                fail(
                    f"{where}{key}",
                    f"{train.deepspeed!r} does not exist ({_where(train.deepspeed, workdir)}); allowed: a DeepSpeed "
                    "JSON file, e.g. config/deepspeed/zero2.json (zero0, zero2, zero3, zero3_offload)",
                )
