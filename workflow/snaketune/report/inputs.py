"""The report's inputs: which files it reads (`ReportInputs`, one `ExperimentFiles` per experiment), the
readers of those files, and `Experiment`, what the sections are drawn from. The sections import this module,
never the builder (snaketune.report.build), so the report's modules form no circle."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ExperimentFiles:
    """One experiment's inputs."""

    name: str
    summary: Path
    metrics: Path
    eval_metrics: Path
    generations: Path
    tokenized: Path
    """The tokenized cache directory (its stats.json is read)."""
    dpo_summary: Path | None = None
    """The preference stage (when it ran): results/dpo/<experiment>/summary.json and metrics.csv, the
    reference stage's record, the tokenized pairs' directory and the pairs stage's stats.json."""
    dpo_metrics: Path | None = None
    reference: Path | None = None
    pairs: Path | None = None
    preferences: Path | None = None
    exports: dict[str, Path] = field(default_factory=dict)
    """The export stage's directories by model (sft, dpo): results/export/<experiment>/<model>."""


@dataclass(frozen=True)
class ReportInputs:
    experiments: list[ExperimentFiles]
    source: Path
    """results/data/raw/source.json"""
    sha256sums: Path
    """results/data/raw/SHA256SUMS"""
    conversations: Path
    """results/data/conversations/stats.json"""
    config: dict
    """The resolved config: dataset, every experiment's model/tokenize/train, eval."""
    benchmarks: Path | None = None
    """Directory of Snakemake's benchmark TSVs; those of the manifest's jobs are reported (current_benchmarks)."""
    manifest: Path | None = None
    """results/provenance/manifest.json (snaketune.provenance): the record of every job behind the report."""
    invocation: dict | None = None
    """How Snakemake was asked to run: {"configfiles": [...], "config_args": [...]} (--configfile and --config
    as given), for the report's reproduce box."""
    benchmark_results: list[Path] = field(default_factory=list)
    """results/benchmark/**/<task>.json: the benchmark stage's scores (snaketune.report.benchmark)."""
    benchmark_bases: dict[str, str] = field(default_factory=dict)
    """Experiment -> the key of its base model's scores (results/benchmark/base/<key>/)."""


def _number(value: str) -> float | str | None:
    if value in ("", "NA", "nan"):
        return None
    try:
        return float(value)
    except ValueError:
        return value


def read_metrics_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def read_sha256sums(path: Path) -> dict[str, str]:
    sums = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip()] = digest
    return sums


def read_benchmarks(directory: Path | None) -> list[dict]:
    """One entry per benchmark TSV (the last row when a job was benchmarked repeatedly), sorted by path."""
    if directory is None or not Path(directory).is_dir():
        return []

    def pipeline_order(path: Path) -> tuple[int, str]:
        top = path.relative_to(directory).parts[0].removesuffix(".tsv")
        return (JOB_ORDER.index(top) if top in JOB_ORDER else len(JOB_ORDER), path.as_posix())

    out = []
    for path in sorted(Path(directory).rglob("*.tsv"), key=pipeline_order):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if not rows:
            continue
        row = {k: _number(v) for k, v in rows[-1].items()}
        out.append(
            {
                "job": path.relative_to(directory).with_suffix("").as_posix(),
                "wall_s": row.get("s"),
                "max_rss_mib": row.get("max_rss"),
                "cpu_time_s": row.get("cpu_time"),
            }
        )
    return out


def gpus_held(job: dict) -> int:
    """GPUs a job of the manifest held: Snakemake's gpu resource it was granted, or for a job of several nodes
    (which asks per node through gres, with gpu 0) the GPUs it saw times its nodes; none when it saw no GPU (its
    ranks ran on CPUs). A job without the resource, on a host with GPUs, holds none: it merely saw them."""
    seen = len(job.get("gpus") or [])
    if not seen:
        return 0
    resources = job.get("resources")
    if resources is None:  # a record without its resources: what it saw
        return seen
    nodes = int(resources.get("nodes", 1) or 1)
    if nodes > 1:
        return seen * nodes
    return min(int(resources.get("gpu", 0) or 0), seen)


def manifest_jobs(manifest: dict) -> list[dict[str, Any]]:
    """One line per job of the provenance manifest, for the report's table and summary.json."""
    jobs = []
    for job in manifest.get("jobs", []):
        wildcards = ",".join(job["wildcards"].values())
        jobs.append(
            {
                "job": f"{job['rule']}[{wildcards}]" if wildcards else job["rule"],
                "rule": job["rule"],
                "start": job["start"],
                "end": job.get("end"),
                "wall_s": job["wall_s"],
                "host": job["host"]["hostname"],
                "gpus": job["gpus"],
                "gpus_held": gpus_held(job),
                "code": job["code"],
                "status": job["status"],
                "record": job["record"],
                "benchmark": next(iter(_mirrored(job)), None),
            }
        )
    return jobs


def _mirrored(job: dict) -> list[str]:
    """The job's benchmark name (its path under benchmarks/, without .tsv): every rule logs to logs/<name>.log
    and benchmarks to benchmarks/<name>.tsv."""
    return [log.removeprefix("logs/").removesuffix(".log") for log in job.get("log") or []]


def current_benchmarks(benchmarks: list[dict], manifest: dict) -> list[dict]:
    """The benchmarks of the jobs behind the report: those named like the log of a manifest job (_mirrored), so a
    removed experiment's or an old cache's leftover TSV is not listed. All of them without a manifest, or with
    one whose records name no logs."""
    logs = {name for job in manifest.get("jobs", []) for name in _mirrored(job)}
    if not logs:
        return benchmarks
    return [b for b in benchmarks if b["job"] in logs]


@dataclass
class Experiment:
    name: str
    summary: dict
    rows: list[dict]
    eval: dict
    generations: list[dict]
    tokenized: dict
    data_key: str
    config: dict
    dpo: dict | None = None
    """{"summary", "rows", "reference", "pairs_stats", "preference_stats"} of the preference stage, or None."""
    exports: dict[str, dict] = field(default_factory=dict)
    """The export stage's metrics.json by model, with its replies ("replies": replies.jsonl's rows)."""


def load(inputs: ReportInputs) -> tuple[dict, list[Experiment]]:
    data = {
        "source": json.loads(Path(inputs.source).read_text()),
        "sha256sums": read_sha256sums(inputs.sha256sums),
        "conversations": json.loads(Path(inputs.conversations).read_text()),
    }
    experiments = []
    for files in inputs.experiments:
        experiments.append(
            Experiment(
                name=files.name,
                summary=json.loads(Path(files.summary).read_text()),
                rows=read_metrics_csv(files.metrics),
                eval=json.loads(Path(files.eval_metrics).read_text()),
                generations=read_jsonl(files.generations),
                tokenized=json.loads((Path(files.tokenized) / "stats.json").read_text()),
                data_key=Path(files.tokenized).name,
                config=inputs.config.get("experiments", {}).get(files.name, {}),
                dpo=None
                if files.dpo_summary is None
                else {
                    "summary": json.loads(Path(files.dpo_summary).read_text()),
                    "rows": read_metrics_csv(files.dpo_metrics),
                    "reference": json.loads(Path(files.reference).read_text()),
                    "pairs_stats": json.loads((Path(files.pairs) / "stats.json").read_text()),
                    "preference_stats": json.loads(Path(files.preferences).read_text()),
                },
                exports={
                    model: json.loads((Path(d) / "metrics.json").read_text())
                    | {"replies": read_jsonl(Path(d) / "replies.jsonl")}
                    for model, d in files.exports.items()
                },
            )
        )
    return data, experiments


JOB_ORDER = (
    "download",
    "conversations",
    "preferences",
    "tokenizer",
    "tokenized",
    "tokenized_pairs",
    "train",
    "reference",
    "dpo",
    "eval",
    "export",
)
"""Top-level names under benchmarks/, in pipeline order (the wall-time table follows it)."""
