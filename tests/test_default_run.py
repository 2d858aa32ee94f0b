"""The embedded default as `make run` runs it (config/config.yaml, three CPU ranks): SFT, then DPO on the builtin
data's ranked siblings, evaluated on held-out pairs. What the README and the report claim for it."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from conftest import NOTHING_TO_DO, SHORT_TIMEOUT_S, copy_workflow, snakemake

pytestmark = pytest.mark.slow

# 2 min 51 s on a quiet two-core machine, the benchmark's 5 jobs 32 s of it (bench/RESULTS.md, "The embedded
# default's time"); the timeout leaves room for a machine others share.
RUN_TIMEOUT_S = 1500
# Every rule of the default's DAG and how often it runs: once, but export's twice (the SFT and the DPO model) and
# the benchmark's once per model and task.
JOBS = {
    "download": 1,
    "plan": 1,
    "plan_dpo": 1,
    "plan_eval": 1,
    "conversations": 1,
    "preferences": 1,
    "train_tokenizer": 1,
    "tokenize": 1,
    "tokenize_pairs": 1,
    "train": 1,
    "export": 2,
    "reference": 1,
    "dpo": 1,
    "evaluate": 1,
    # the benchmark (tasks: auto, builtin_choice for the builtin data) on the base, SFT and DPO model and on each
    # one's q4_k_m file
    "benchmark_base": 1,
    "benchmark": 2,
    "benchmark_gguf": 2,
    "manifest": 1,
    "report": 1,
    "all": 1,
}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("default"))
    result = snakemake(workdir, "--cores", "2", "--resources", "gpu=3", timeout=RUN_TIMEOUT_S)
    return workdir, result


def test_dpo_beats_sft_on_held_out_preferences_without_costing_sft_quality(default_run):
    workdir, _ = default_run
    metrics = json.loads((workdir / "results/eval/default/metrics.json").read_text())
    pref, val = metrics["preference"], metrics["validation"]
    assert metrics["models"] == ["base", "tuned", "dpo"] and pref["dpo"]["pairs"] >= 80
    # The builtin data carries a signal the SFT model does not already separate perfectly...
    assert pref["tuned"]["accuracy"] < 0.9
    # ...and DPO learns it: at least 20 points more held-out pairs ranked right, the SFT validation loss at
    # most 5% worse (the bar).
    assert pref["dpo"]["accuracy"] >= pref["tuned"]["accuracy"] + 0.20, pref
    assert val["dpo"]["loss"] <= 1.05 * val["tuned"]["loss"], val
    assert pref["dpo"]["reward_accuracy"] > 0.8
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    shown = summary["experiments"]["default"]["preference"]
    assert shown["preference_accuracy"]["dpo"] == pref["dpo"]["accuracy"]
    html = (workdir / "results/report/index.html").read_text(encoding="utf-8")
    assert "Preference tuning" in html and "preference accuracy" in html


def test_the_default_runs_every_stage_once(default_run):
    """Each rule ran once (export once per model) and the run is complete: a dry run after it has nothing to do."""
    workdir, result = default_run
    assert Counter(result.finished_rules) == JOBS
    dpo = json.loads((workdir / "results/dpo/default/summary.json").read_text())
    sft = json.loads((workdir / "results/train/default/summary.json").read_text())
    assert sft["world_size"] == dpo["world_size"] == 3
    assert dpo["steps"] == 100 and dpo["objective"] == "dpo"
    stats = json.loads((workdir / "results/data/preferences/best_vs_rest/stats.json").read_text())
    assert stats["pairs"]["train"] > 300 and sum(stats["groups_dropped"].values()) > 0
    dry = snakemake(workdir, "-n", "--cores", "2", "--resources", "gpu=3")
    assert NOTHING_TO_DO in dry.output and dry.planned_rules == [], dry.output[-3000:]


def test_a_second_invocation_does_nothing(default_run):
    """`make run` again runs no job, and fewer granted GPUs change nothing the rules depend on."""
    workdir, _ = default_run
    summary = workdir / "results/dpo/default/summary.json"
    mtime = summary.stat().st_mtime_ns
    again = snakemake(workdir, "--cores", "2", "--resources", "gpu=3", timeout=SHORT_TIMEOUT_S)
    assert NOTHING_TO_DO in again.output and again.finished_rules == [], again.output[-3000:]
    fewer = snakemake(workdir, "-n", "--cores", "2", "--resources", "gpu=2")
    assert NOTHING_TO_DO in fewer.output and fewer.planned_rules == [], fewer.output[-3000:]
    assert summary.stat().st_mtime_ns == mtime


def test_snakemakes_report_holds_the_report_and_the_runs_records(default_run, tmp_path):
    workdir, _ = default_run
    zip_path = tmp_path / "report.zip"
    snakemake(workdir, "--report", str(zip_path))
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
    assert "report/report.html" in names, names
    assert {"metrics.csv", "summary.json", "source.json", "stats.json"} <= {Path(n).name for n in names}
    html = tmp_path / "report.html"
    snakemake(workdir, "--report", str(html))
    assert html.stat().st_size > 0


def test_the_report_has_the_benchmark_table_on_the_local_tasks(default_run):
    """Base, SFT, DPO and the DPO model's q4_k_m file on the task `tasks: auto` picks for the builtin data, each score with its standard error and
    each model's change against the base with its interval; the SFT model learnt the builtin questions' facts
    (multiple choice above the base's chance level)."""
    workdir, _ = default_run
    report = (workdir / "results/report/report.md").read_text()
    table = report[report.index("### default: forgetting") :].split("\n\n")[1]
    header, _, *rows = table.splitlines()
    for column in (
        "| base |",
        "| SFT |",
        "| DPO |",
        "| DPO q4_k_m |",
        "| SFT − base |",
        "| DPO q4_k_m − base |",
    ):
        assert column in header, column
    tasks = {row.split("|")[1].strip() for row in rows}
    assert tasks == {"builtin_choice"} and all(" ± " in row for row in rows)
    assert "Why these tasks: benchmark.tasks auto, for the builtin data" in report
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    choice = summary["benchmark"]["experiments"]["default"]["builtin_choice"]
    assert choice["n"] == 200
    acc = choice["metrics"]["acc,none"]
    assert (
        acc["scores"]["sft"]["value"] > acc["scores"]["base"]["value"] + 2 * acc["scores"]["sft"]["stderr"]
    ), acc
