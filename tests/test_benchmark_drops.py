"""Drops beyond benchmark.max_drop (issue #53): which changes against the base the report judges and which it flags,
the first screen saying so before anything else, and rule benchmark_gate failing the run on a drop once the report
is written (on a hand-made results tree, then through Snakemake on a clone of the tiny run with a forced drop)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import clone_run, dry_run, job_stats, snakemake
from report_tree import benchmark_result, make_results
from snaketune import verify
from snaketune.config.benchmark import BenchmarkConfig
from snaketune.config.choices import ConfigError
from snaketune.provenance import load_records
from snaketune.report import build as report
from snaketune.report.benchmark import benchmark_summary, beyond_max_drop, change
from snaketune.report.gate import DropBeyondMaxDrop, NothingJudged, check_drops

RIGHT = [1.0] * 40
"""The base model answers all 40 questions right."""


def _lose(k: int) -> list[float]:
    """A model that gets k of the 40 questions wrong."""
    return [1.0] * (40 - k) + [0.0] * k


def _changes(summary: dict, exp: str) -> dict:
    return summary["experiments"][exp]["builtin_choice"]["metrics"]["acc,none"]["change_vs_base"]


# ---- what is judged, and what is flagged -------------------------------------------------------------------


def test_a_drop_is_flagged_only_where_its_whole_interval_lies_below_max_drop(tmp_path):
    """The DPO experiment's final model loses 1 question (within the noise), its q8_0 file 4 (worse than the base
    beyond the noise, 10 points on average, but the interval reaches above -2 points), its q4_k_m file 20 (flagged).
    The SFT model before DPO loses all 40 and is not judged: the final model is. An SFT-only experiment's SFT model
    is its final one, judged and flagged."""
    paths = [
        benchmark_result(tmp_path, "k", "base", "base", RIGHT),
        benchmark_result(tmp_path, "exp", "sft", "tuned", _lose(40)),
        benchmark_result(tmp_path, "exp", "dpo", "tuned", _lose(1)),
        benchmark_result(tmp_path, "exp", "dpo-q8_0", "gguf", _lose(4)),
        benchmark_result(tmp_path, "exp", "dpo-q4_k_m", "gguf", _lose(20)),
        benchmark_result(tmp_path, "sft_only", "sft", "tuned", _lose(20)),
    ]
    bases = {"exp": "k", "sft_only": "k"}
    summary = benchmark_summary(paths, bases, max_drop=2.0)
    changes = _changes(summary, "exp")
    assert changes["dpo"]["beyond_max_drop"] is False and not changes["dpo"]["worse"]
    assert changes["dpo-q8_0"]["worse"] and changes["dpo-q8_0"]["delta"] == pytest.approx(-0.10)
    assert changes["dpo-q8_0"]["ci95"][1] > -0.02 and changes["dpo-q8_0"]["beyond_max_drop"] is False
    assert changes["dpo-q4_k_m"]["beyond_max_drop"] is True
    assert changes["sft"]["worse"] and "beyond_max_drop" not in changes["sft"]
    flagged = {(d["experiment"], d["model"]) for d in summary["drops"]}
    assert flagged == {("exp", "dpo-q4_k_m"), ("sft_only", "sft")}
    (drop,) = [d for d in summary["drops"] if d["model"] == "dpo-q4_k_m"]
    assert (drop["task"], drop["metric"], drop["n"]) == ("builtin_choice", "acc,none", 40)
    assert drop["ci95"][1] < -0.02 and drop["delta"] == pytest.approx(-0.5)
    # max_drop 0: every change of a final model that is worse beyond the noise, no more.
    at_zero = benchmark_summary(paths, bases, max_drop=0.0)
    assert {(d["experiment"], d["model"]) for d in at_zero["drops"]} == flagged | {("exp", "dpo-q8_0")}
    # A loss of all 40 is no drop beyond 100 points: the interval [-100, -100] does not lie below -100.
    assert benchmark_summary(paths, bases, max_drop=100.0)["drops"] == []


def test_a_metric_that_is_not_a_share_is_shown_but_not_judged():
    """BLEU (0-100, higher is better) falling 15 is worse beyond the noise, but its change is not in points."""
    metric = {"metric": "bleu", "filter": "none", "stderr": 0.1, "higher_is_better": True}
    before = {"metrics": {"bleu,none": {**metric, "value": 35.0}}, "samples": []}
    after = {"metrics": {"bleu,none": {**metric, "value": 20.0}}, "samples": []}
    c = change(before, after, "bleu,none")
    assert c["worse"] and not beyond_max_drop(c, 2.0) and not beyond_max_drop(c, 0.0)


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"max_drop": -1}, "benchmark.max_drop"),
        ({"max_drop": 101}, "benchmark.max_drop"),
        ({"max_drop": True}, "benchmark.max_drop"),
        ({"fail_on_drop": True, "enabled": False}, "benchmark.fail_on_drop"),
        ({"fail_on_drop": True, "models": ("sft", "dpo")}, "benchmark.fail_on_drop"),
    ],
)
def test_bad_drop_settings_name_the_key(settings, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        BenchmarkConfig(**settings)


# ---- the first screen and the gate on a built report --------------------------------------------------------


def _build(tmp_path: Path, dpo_wrong: int, *, fail_on_drop: bool, base: bool = True) -> Path:
    """The hand-made results tree (report_tree: `default` ends with DPO, `lora` with SFT), with benchmark results:
    the DPO model gets `dpo_wrong` of 40 questions wrong, lora's SFT model 1. Returns the report's directory."""
    inputs = make_results(tmp_path)
    bench = tmp_path / "results/benchmark"
    paths = [
        benchmark_result(bench, "default", "sft", "tuned", _lose(1)),
        benchmark_result(bench, "default", "dpo", "tuned", _lose(dpo_wrong)),
        benchmark_result(bench, "lora", "sft", "tuned", _lose(1)),
    ]
    if base:
        paths.append(benchmark_result(bench, "k", "base", "base", RIGHT))
    inputs = replace(
        inputs,
        benchmark_results=[Path(p) for p in paths],
        benchmark_bases={"default": "k", "lora": "k"},
        config={**inputs.config, "benchmark": {"max_drop": 2, "fail_on_drop": fail_on_drop}},
    )
    report.build_report(inputs, tmp_path / "out", workdir=tmp_path)
    return tmp_path / "out"


def _first_screen(out: Path) -> str:
    md = (out / "report.md").read_text()
    return md[md.index("## Did it help?") : md.index("## Data")]


def test_the_first_screen_says_a_drop_before_anything_else(tmp_path):
    """Right under "Did it help?", before the experiments' figures: the drop with its task, model, metric, change
    and interval, and whether the run fails on it."""
    top = _first_screen(_build(tmp_path / "fails", 20, fail_on_drop=True))
    first = top.split("\n\n")[1]
    assert first.startswith("**Forgetting beyond `benchmark.max_drop` (2 points)**"), top
    assert "**The run fails on it** (`benchmark.fail_on_drop`)." in first
    bullets = top.split("\n\n")[2]
    assert (
        bullets.startswith("- default DPO: builtin_choice acc −50.0 points [−") and "(40 examples)" in bullets
    )
    assert "lora" not in bullets
    assert top.index("Forgetting beyond") < top.index("**default**")
    html = (tmp_path / "fails/out/index.html").read_text()
    assert html.index("Forgetting beyond") < html.index("the final model is the")
    # The same drop without fail_on_drop: said first all the same, with the switch that would fail the run.
    first = _first_screen(_build(tmp_path / "flags", 20, fail_on_drop=False)).split("\n\n")[1]
    assert first.startswith("**Forgetting beyond") and "`benchmark.fail_on_drop: true` fails the run" in first
    # A loss within the noise: nothing said.
    assert "Forgetting" not in _first_screen(_build(tmp_path / "noise", 1, fail_on_drop=True))


def test_the_gate_fails_naming_each_drop_and_records_what_it_judged_otherwise(tmp_path):
    out = _build(tmp_path / "drop", 20, fail_on_drop=True)
    with pytest.raises(DropBeyondMaxDrop) as e:
        check_drops(out / "summary.json", out / "gate.json")
    assert "benchmark.max_drop (2 points)" in str(e.value)
    assert "default DPO: builtin_choice acc −50.0 points [−" in str(e.value) and "index.html" in str(e.value)
    assert not (out / "gate.json").exists()
    out = _build(tmp_path / "fine", 1, fail_on_drop=True)
    result = check_drops(out / "summary.json", out / "gate.json")
    assert json.loads((out / "gate.json").read_text()) == result
    assert {(j["experiment"], j["model"]) for j in result["judged"]} == {("default", "dpo"), ("lora", "sft")}
    assert result["drops"] == [] and not any(j["beyond_max_drop"] for j in result["judged"])


def test_a_gate_with_nothing_to_judge_fails_saying_so(tmp_path):
    """Without the base model's scores no change is judged: fail_on_drop's check cannot pass by default."""
    out = _build(tmp_path, 20, fail_on_drop=True, base=False)
    with pytest.raises(NothingJudged, match="judged no benchmark score"):
        check_drops(out / "summary.json", out / "gate.json")


# ---- the real workflow -------------------------------------------------------------------------------------

ARGS = ("--cores", "2", "--resources", "gpu=2", "--configfile", "tiny.yaml")


def _force_scores(workdir: Path, path: str, value: float) -> None:
    """Every example of a benchmark result scored `value`, and its job's record saying so (as if the job had
    written it): the preflight check then takes it for the job's output, and the report and the gate read it."""
    file = workdir / path
    result = json.loads(file.read_text())
    for m in result["metrics"].values():
        m["value"], m["stderr"] = value, 0.0
        for s in result["samples"]:
            s[m["metric"]] = value
    file.write_text(json.dumps(result))
    records = load_records(workdir / "results/provenance")
    (record_path,) = [p for p, r in records.items() if path in r["outputs"]]
    records[record_path]["outputs"][path] = verify.describe(file)
    Path(record_path).write_text(json.dumps(records[record_path]))


@pytest.mark.slow
def test_a_forced_drop_fails_the_run_once_the_report_is_written(tiny_run, tmp_path):
    """The tiny run with the base model right on every builtin_choice question and the final (DPO) model wrong on
    each: with fail_on_drop the run exits 1 naming the drop after writing the report, which says it first; only the
    report's jobs and the gate ran; the next run checks again; without fail_on_drop the run ends green."""
    workdir = clone_run(tiny_run, tmp_path / "wf")
    (base,) = (workdir / "results/benchmark/base").glob("*/builtin_choice.json")
    _force_scores(workdir, base.relative_to(workdir).as_posix(), 1.0)
    _force_scores(workdir, "results/benchmark/default/dpo/builtin_choice.json", 0.0)
    (workdir / "gate.yaml").write_text(json.dumps({"benchmark": {"fail_on_drop": True}}))
    cmd = [str(Path(sys.executable).parent / "snakemake"), *ARGS, "gate.yaml"]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "ERROR in rule benchmark_gate: DropBeyondMaxDrop" in output, output[-3000:]
    assert "default DPO: builtin_choice acc −100.0 points [−100.0, −100.0] (4 examples)" in output
    assert set(job_stats(output)) == {"manifest", "report", "benchmark_gate", "all"}, output[-3000:]
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    assert ("default", "dpo", "builtin_choice") in {
        (d["experiment"], d["model"], d["task"]) for d in summary["benchmark"]["drops"]
    }
    top = _first_screen(workdir / "results/report")
    assert top.split("\n\n")[1].startswith("**Forgetting beyond `benchmark.max_drop` (2 points)**")
    assert "**The run fails on it**" in top and not (workdir / "results/report/gate.json").exists()
    # The failed check left no output: the next run repeats it, and nothing else.
    code, dry = dry_run(workdir, (*ARGS, "gate.yaml"))
    assert code == 0 and set(job_stats(dry)) == {"benchmark_gate", "all"}, dry[-3000:]
    # The switch off: the report still says it first, and the run ends green.
    (workdir / "gate.yaml").write_text(json.dumps({"benchmark": {"fail_on_drop": False}}))
    snakemake(workdir, *ARGS, "gate.yaml", timeout=900)
    assert "`benchmark.fail_on_drop: true` fails the run" in _first_screen(workdir / "results/report")
