"""The embedded default as `make run` runs it (config/config.yaml, three CPU ranks): SFT, then DPO on the builtin
data's ranked siblings, evaluated on held-out pairs. What the README and the report claim for it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import copy_workflow
from test_workflow import NOTHING_TO_DO, snakemake

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 900  # about 2.5 minutes on a quiet two-core machine, 3.5 in the suite
# Every rule of the default's DAG and how often it runs: once, but export's twice (the SFT and the DPO model).
JOBS = {
    "download": 1,
    "plan": 1,
    "plan_dpo": 1,
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
    assert dpo["steps"] == 200 and dpo["objective"] == "dpo"
    stats = json.loads((workdir / "results/data/preferences/best_vs_rest/stats.json").read_text())
    assert stats["pairs"]["train"] > 300 and sum(stats["groups_dropped"].values()) > 0
    dry = snakemake(workdir, "-n", "--cores", "2", "--resources", "gpu=3")
    assert NOTHING_TO_DO in dry.output and dry.planned_rules == [], dry.output[-3000:]
