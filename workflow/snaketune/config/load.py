"""Loading the configuration: the YAML mapping (Snakemake's ``config``) into the typed dataclasses.

The workflow calls ``load_config`` before anything else. Each section's dataclass checks its keys as they are
declared (snaketune.config.fields: the type, the allowed values) and then what one key cannot say alone; here
come an unknown key's short message with the nearest allowed key, experiments merged over the top-level sections,
and the checks across sections. ``from_dict`` builds one section (the ranks rebuild theirs from the run spec),
``to_dict`` turns any of them back into plain data, and ``defaults`` is the YAML of every default (config.yaml
spells it out; tests/test_config_sources.py holds the two equal).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from snaketune.config.benchmark import BenchmarkConfig
from snaketune.config.choices import EXPERIMENT_NAME, ConfigError, fail
from snaketune.config.evaluation import EvalConfig
from snaketune.config.export import ExportConfig
from snaketune.config.fields import hints
from snaketune.config.preference import PreferenceConfig
from snaketune.config.schema import (
    Config,
    DatasetConfig,
    ExperimentConfig,
    ModelConfig,
    TokenizeConfig,
    TrainConfig,
)
from snaketune.device_memory import card_gib

SECTIONS = {
    "dataset": DatasetConfig,
    "model": ModelConfig,
    "tokenize": TokenizeConfig,
    "train": TrainConfig,
    "preference": PreferenceConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "benchmark": BenchmarkConfig,
}
"""The config's sections, in config.yaml's order, and the dataclass each one is."""
EXPERIMENT_SECTIONS = ("model", "tokenize", "train", "preference")
"""The sections an experiment may override (the others are shared by all experiments)."""
TOP_LEVEL_VALUES = ("gpu_memory_gib", "gpu_ids")
"""Top-level keys that are values, not sections (Config's fields of those names, their docstrings)."""
TOP_LEVEL = (*SECTIONS, *TOP_LEVEL_VALUES, "experiments")
"""Every top-level key, in config.yaml's order."""
DEFAULT_EXPERIMENTS = {"default": {}}
"""`experiments` where the config names none: one experiment, the top-level sections as they are."""


def _check_keys(mapping: dict, allowed: Iterable[str], where: str) -> None:
    """An unknown key: its full name and the nearest allowed one (else every allowed one), in one line."""
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            guess = difflib.get_close_matches(str(key), allowed, n=1)
            near = f"did you mean '{guess[0]}'?" if guess else f"allowed: {', '.join(allowed)}"
            fail(f"{where}{key}", f"unknown key; {near}")


def from_dict(cls: type, values: dict | None, where: str) -> Any:
    """One section from its mapping, `where` its place in the config (`train.`, `experiments.x.train.`,
    `preference.train.`): an error names the key there."""
    values = {} if values is None else dict(values)
    _check_keys(values, [f.name for f in dataclasses.fields(cls)], where)
    kwargs = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(hints(cls)[name]) and isinstance(value, dict):
            value = from_dict(hints(cls)[name], value, f"{where}{name}.")  # train.lora
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(cls.SECTION, where) from None


def defaults() -> dict[str, Any]:
    """Every key's default as the YAML spells it (config/config.yaml's values)."""
    return {
        **{name: to_dict(cls()) for name, cls in SECTIONS.items()},
        **{f.name: f.default for f in dataclasses.fields(Config) if f.name in TOP_LEVEL_VALUES},
        "experiments": copy.deepcopy(DEFAULT_EXPERIMENTS),
    }


def set_in(key: str | None, layers: Iterable[tuple[str, dict]]) -> str | None:
    """Which of the config's layers (name, mapping: config/config.yaml, each --configfile, --config; the later
    wins) sets the dotted `key`, for an error to name the file; None where none does."""
    found = None
    for name, mapping in layers:
        if key is not None and _holds(mapping, key):
            found = name
    return found


def _holds(mapping: Any, key: str) -> bool:
    """Whether `mapping` has the dotted key (experiment names may hold dots: each split is tried)."""
    if not isinstance(mapping, dict):
        return False
    if key in mapping:
        return True
    return any(
        _holds(mapping[k], key[len(k) + 1 :])
        for k in mapping
        if isinstance(k, str) and key.startswith(f"{k}.")
    )


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_config_files(paths: Iterable[str | Path]) -> dict[str, Any]:
    """The mapping Snakemake makes of config files (the Snakefile's configfile, then each ``--configfile``): each file
    merged over the ones before it, key by key. For scripts outside the workflow that read a run's config as it did."""
    import yaml

    raw: dict[str, Any] = {}
    for path in paths:
        raw = _deep_merge(raw, yaml.safe_load(Path(path).read_text()) or {})
    return raw


def load_config(raw: dict[str, Any]) -> Config:
    """Build and check the typed config from the YAML mapping (snakemake's ``config``)."""
    raw = dict(raw or {})
    _check_keys(raw, TOP_LEVEL, "")
    # A section left empty in the YAML (`train:` with nothing under it) is null: none of its keys set.
    for name in SECTIONS:
        if not isinstance(raw.get(name, {}), dict | None):
            fail(name, f"must be a mapping of {name} settings, got {raw[name]!r}")
    dataset = from_dict(DatasetConfig, raw.get("dataset"), "dataset.")
    experiments_raw = raw.get("experiments")
    if not isinstance(experiments_raw, dict | None):
        fail("experiments", "must map experiment names to overrides (e.g. default: {})")
    experiments_raw = experiments_raw or DEFAULT_EXPERIMENTS
    experiments = {}
    for name, override in experiments_raw.items():
        if not isinstance(name, str) or not EXPERIMENT_NAME.match(name):
            fail(f"experiments.{name}", "experiment names use letters, digits, '_', '-', '.' (max 64)")
        if not isinstance(override, dict | None):
            fail(f"experiments.{name}", "must be a mapping of overrides of model/tokenize/train/preference")
        override = override or {}
        _check_keys(override, EXPERIMENT_SECTIONS, f"experiments.{name}.")
        sections = {}
        merged_sections = {}
        for section in EXPERIMENT_SECTIONS:
            if not isinstance(override.get(section), dict | None):
                fail(f"experiments.{name}.{section}", f"must be a mapping of {section} settings")
            merged = _deep_merge(raw.get(section) or {}, override.get(section) or {})
            merged_sections[section] = merged
            where = f"experiments.{name}.{section}." if section in override else f"{section}."
            sections[section] = from_dict(SECTIONS[section], merged, where)
        dpo_train = None
        if sections["preference"].enabled:
            where = (
                f"experiments.{name}.preference.train." if "preference" in override else "preference.train."
            )
            merged = _deep_merge(merged_sections["train"], sections["preference"].train or {})
            dpo_train = from_dict(TrainConfig, merged, where)
        for train, where in ((sections["train"], "train."), (dpo_train, "preference.train.")):
            if train is not None and train.lora.quantize != "none" and sections["model"].is_builtin:
                fail(
                    f"experiments.{name}.{where}lora.quantize",
                    f"{train.lora.quantize!r} quantizes a pretrained model's weights as they load; model.base "
                    f"{sections['model'].base!r} is built here (use a hub id or a hub-format directory, or quantize: none)",
                )
        experiments[name] = ExperimentConfig(name=name, dataset=dataset, dpo_train=dpo_train, **sections)
    check_pairs_source(dataset, experiments, raw)
    eval_cfg = from_dict(EvalConfig, raw.get("eval"), "eval.")
    export_cfg = from_dict(ExportConfig, raw.get("export"), "export.")
    benchmark_cfg = from_dict(BenchmarkConfig, raw.get("benchmark"), "benchmark.")
    gpu_memory_gib = raw.get("gpu_memory_gib")
    if gpu_memory_gib is not None:
        try:
            gpu_memory_gib = card_gib(gpu_memory_gib)
        except ValueError as e:
            fail("gpu_memory_gib", str(e))
    gpu_ids = raw.get("gpu_ids")
    if gpu_ids is not None:
        if not isinstance(gpu_ids, list) or not gpu_ids or not all(_gpu_id(i) for i in gpu_ids):
            fail("gpu_ids", f"{gpu_ids!r} must be a list of GPU ids (e.g. [0, 1]), or null")
        gpu_ids = tuple(str(i) for i in gpu_ids)
    return Config(
        dataset=dataset,
        experiments=experiments,
        raw=raw,
        eval=eval_cfg,
        export=export_cfg,
        benchmark=benchmark_cfg,
        gpu_memory_gib=None if gpu_memory_gib is None else float(gpu_memory_gib),
        gpu_ids=gpu_ids,
    )


def _gpu_id(value: Any) -> bool:
    """A GPU id as CUDA_VISIBLE_DEVICES takes it: an index or a UUID (`GPU-...`)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def check_pairs_source(dataset: DatasetConfig, experiments: dict[str, ExperimentConfig], raw: dict) -> None:
    """Chat-format data has no ranks to pair replies by: an experiment that tunes on preferences must name a pairs
    file then. Checked when the config loads (dataset.format: chat) and again once `auto` is told from the file
    (snaketune.data.formats)."""
    if dataset.format != "chat":
        return
    for name, exp in experiments.items():
        if not exp.preference.enabled or exp.preference.from_file:
            continue
        overrides = (raw.get("experiments") or {}).get(name) or {}
        where = f"experiments.{name}.preference" if "preference" in overrides else "preference"
        fail(
            f"{where}.source",
            f"'dataset' pairs replies by the ranks of oasst-format data, and dataset.source {dataset.source!r} is "
            "chat-format (no ranks); allowed: a pairs file (.jsonl, .jsonl.gz or .parquet with prompt, chosen, "
            f"rejected) as {where}.source, or {where}.enabled: false",
        )


def to_dict(obj: Any) -> Any:
    """A dataclass as plain JSON-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def resolve_in_workdir(path: str, key: str, workdir: Path | None = None) -> Path:
    """A user-given input path, checked to exist."""
    p = Path(path)
    if workdir is not None and not p.is_absolute():
        p = workdir / p
    if not p.exists():
        fail(key, f"file {str(p)!r} does not exist")
    return p
