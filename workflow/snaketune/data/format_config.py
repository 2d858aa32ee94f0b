"""dataset.format `auto` told when the config loads (the workflow calls this when Snakemake builds the DAG), apart
from snaketune.data.formats: the download stage reads files with that module, and its code hash must not follow the
config loading this needs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from snaketune.config.choices import fail
from snaketune.config.load import check_pairs_source
from snaketune.data.formats import detect_format
from snaketune.data.jsonl import DataError


def resolve_format(cfg, workdir: str | Path = "."):
    """`cfg` (snaketune.config.schema.Config) with dataset.format `auto` replaced by the format the data is read as;
    ConfigError when it cannot be told, or when chat-format data meets an experiment that takes its preference pairs
    from the dataset's ranks (snaketune.config.load.check_pairs_source)."""
    ds = cfg.dataset
    if ds.source == "builtin" or ds.source.startswith("hub:"):
        fmt = "oasst"  # a hub dataset is read in the oasst schema (DatasetConfig refuses chat for it)
    elif ds.format != "auto":
        fmt = ds.format
    else:
        path = Path(ds.source).expanduser()
        try:
            fmt = detect_format(path if path.is_absolute() else Path(workdir) / path)
        except DataError as e:
            fail("dataset.format", f"auto: {e}")
    dataset = dataclasses.replace(ds, format=fmt)
    experiments = {name: dataclasses.replace(exp, dataset=dataset) for name, exp in cfg.experiments.items()}
    check_pairs_source(dataset, experiments, cfg.raw)
    return dataclasses.replace(cfg, dataset=dataset, experiments=experiments)
