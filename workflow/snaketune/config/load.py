"""Loading the configuration: the YAML mapping (Snakemake's ``config``) into the typed dataclasses.

The workflow validates the YAML against workflow/schemas/config.schema.yaml and then calls ``load_config``,
which adds what a JSON schema cannot say well: "did you mean" for typos, the type each key takes, experiments
merged over the top-level sections, cross-section checks. ``from_dict`` builds one section (the ranks rebuild
theirs from the run spec) and ``to_dict`` turns any of them back into plain data.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from snaketune.config.benchmark import BenchmarkConfig
from snaketune.config.choices import EXPERIMENT_NAME, ConfigError, fail
from snaketune.config.evaluation import EvalConfig
from snaketune.config.export import ExportConfig
from snaketune.config.preference import PreferenceConfig
from snaketune.config.schema import (
    Config,
    DatasetConfig,
    ExperimentConfig,
    LoraConfig,
    ModelConfig,
    TokenizeConfig,
    TrainConfig,
)
from snaketune.device_memory import card_gib

_SECTIONS = {
    "dataset": DatasetConfig,
    "model": ModelConfig,
    "tokenize": TokenizeConfig,
    "train": TrainConfig,
    "preference": PreferenceConfig,
}


_EXPERIMENT_SECTIONS = ("model", "tokenize", "train", "preference")


# Top-level keys that are not dataclass sections; other issues' stages add theirs here.
_OTHER_TOP_LEVEL = ("experiments", "eval", "export", "report", "gpu_memory_gib", "gpu_ids", "benchmark")


def _check_keys(mapping: dict, allowed: list[str], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            guess = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            fail(f"{where}{key}", f"unknown key{hint} allowed: {', '.join(allowed)}")


_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "tuple": "a list",
    "LoraConfig": "a mapping of LoRA settings",
    "dict": "a mapping",
}


def _type_ok(value: Any, name: str) -> bool:
    if name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if name == "bool":
        return isinstance(value, bool)
    if name == "str":
        return isinstance(value, str)
    if name == "tuple":
        return isinstance(value, list | tuple)
    return isinstance(value, dict)  # a nested section (LoraConfig)


def _check_type(key: str, value: Any, annotation: str, choices: tuple[str, ...] | None = None) -> None:
    """The value has the field's type (`int | None`, `tuple[str, ...]`, ...): a YAML or --config value of the
    wrong type gets the key and the expected type (a field's `choices` where it has some), not a TypeError from a
    comparison in __post_init__."""
    options = [part.strip().split("[")[0] for part in annotation.split("|")]
    if value is None and "None" in options:
        return
    if any(_type_ok(value, name) for name in options if name != "None"):
        return
    allowed = (
        ", ".join(choices)
        if choices
        else " or ".join(_TYPE_NAMES.get(name, name) for name in options if name != "None")
    )
    if "None" in options:
        allowed += " or null"
    fail(key, f"{value!r} ({type(value).__name__}) is not allowed; allowed: {allowed}")


def from_dict(cls: type, values: dict | None, where: str) -> Any:
    values = dict(values or {})
    names = [f.name for f in dataclasses.fields(cls)]
    _check_keys(values, names, where)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        _check_type(f"{where}{f.name}", v, str(f.type), getattr(cls, "CHOICES", {}).get(f.name))
        item = re.match(r"tuple\[(\w+)", str(f.type))  # tuple[str, ...], tuple[float, float]
        if item and isinstance(v, list | tuple):
            for x in v:
                _check_type(f"{where}{f.name}", x, item.group(1))
        if f.name == "lora":
            v = from_dict(LoraConfig, v, f"{where}lora.")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - guarded by _check_keys
        raise ConfigError(f"config section '{where.rstrip('.')}': {e}") from e


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
    _check_keys(raw, list(_SECTIONS) + list(_OTHER_TOP_LEVEL), "")
    dataset = from_dict(DatasetConfig, raw.get("dataset"), "dataset.")
    experiments_raw = raw.get("experiments") or {"default": {}}
    if not isinstance(experiments_raw, dict):
        fail("experiments", "must map experiment names to overrides (e.g. default: {})")
    experiments = {}
    for name, override in experiments_raw.items():
        if not isinstance(name, str) or not EXPERIMENT_NAME.match(name):
            fail(f"experiments.{name}", "experiment names use letters, digits, '_', '-', '.' (max 64)")
        override = override or {}
        if not isinstance(override, dict):
            fail(f"experiments.{name}", "must be a mapping of overrides of model/tokenize/train")
        _check_keys(override, list(_EXPERIMENT_SECTIONS), f"experiments.{name}.")
        sections = {}
        merged_sections = {}
        for section in _EXPERIMENT_SECTIONS:
            merged = _deep_merge(raw.get(section) or {}, override.get(section) or {})
            merged_sections[section] = merged
            where = f"experiments.{name}.{section}." if section in override else f"{section}."
            sections[section] = from_dict(_SECTIONS[section], merged, where)
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
    if not isinstance(raw.get("eval") or {}, dict):
        fail("eval", f"must be a mapping of eval settings, got {raw['eval']!r}")
    eval_cfg = from_dict(EvalConfig, raw.get("eval"), "eval.")
    if not isinstance(raw.get("export") or {}, dict):
        fail("export", f"must be a mapping of export settings, got {raw['export']!r}")
    export_cfg = from_dict(ExportConfig, raw.get("export"), "export.")
    if not isinstance(raw.get("benchmark") or {}, dict):
        fail("benchmark", f"must be a mapping of benchmark settings, got {raw['benchmark']!r}")
    benchmark_cfg = from_dict(BenchmarkConfig, raw.get("benchmark"), "benchmark.")
    gpu_memory_gib = raw.get("gpu_memory_gib")
    if gpu_memory_gib is not None:
        try:
            gpu_memory_gib = card_gib(gpu_memory_gib)
        except ValueError as e:
            fail("gpu_memory_gib", str(e))
    gpu_ids = raw.get("gpu_ids")
    if gpu_ids is not None:
        if not isinstance(gpu_ids, list) or not gpu_ids or any(isinstance(i, bool) for i in gpu_ids):
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
