"""Reproducibility: a change reruns exactly the stages it touches, and every job leaves a provenance record.

One completed run of the tiny config in a copy of the workflow (conftest.tiny_run); then, for each kind of change, the change
is applied in the copy (an extra config file, or an edited file whose bytes and timestamps are restored
afterwards), Snakemake dry-runs, and the rules of its "Job stats" table must be exactly the expected ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import NOTHING_TO_DO, clone_run, dry_run, job_stats, snakemake
from rerun_cases import CASES, TOKENIZER, edit_line

pytestmark = pytest.mark.slow

CONFIG = "tiny.yaml"  # copied into the working directory with the workflow (conftest.tiny_run)
CHANGE = "change.yaml"  # a second --configfile holding the change under test

# ---- helpers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def edited(path: Path, old: str | None, new: str | None) -> Iterator[None]:
    """The file changed for the duration; then its bytes and its timestamps are as before (Snakemake
    compares input mtimes, so a restored file must not look newer than the outputs)."""
    data, stat = path.read_bytes(), path.stat()
    text = data.decode()
    if old is None:
        changed = text + edit_line(path, "tests/test_reproducibility.py")
    else:
        assert text.count(old) == 1, f"{old!r} not found once in {path}"
        changed = text.replace(old, new)
    path.write_text(changed)
    try:
        yield
    finally:
        path.write_bytes(data)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def args(*extra: str, configs: tuple[str, ...] = (CONFIG,)) -> tuple[str, ...]:
    return (*extra, "--cores", "2", "--resources", "gpu=2", "--configfile", *configs)


def planned(workdir: Path, configs: tuple[str, ...] = (CONFIG,)) -> dict[str, int]:
    """rule -> job count of a dry run (forked in-process: conftest.dry_run)."""
    code, output = dry_run(workdir, args(configs=configs))
    assert code == 0, output[-4000:]
    return job_stats(output)


# ---- the completed run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tiny_run, tmp_path_factory, deepseek_tokenizer) -> Path:
    """A copy of the shared tiny run (conftest.tiny_run: one complete run from scratch, made with hub tokens in the
    environment), so that the edits below never touch the run other tests read; the real tokenizer beside it for
    model.tokenizer's change."""
    workdir = clone_run(tiny_run, tmp_path_factory.mktemp("reproducibility") / "wf")
    shutil.copytree(deepseek_tokenizer, workdir / TOKENIZER)
    return workdir


def test_a_completed_run_reruns_nothing(workdir):
    result = snakemake(workdir, "--cores", "all", "--resources", "gpu=2", "--configfile", CONFIG)
    assert NOTHING_TO_DO in result.output
    assert result.finished_rules == []


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_reruns_exactly_what_it_touches(workdir, case):
    (kind, change), expected = CASES[case]
    if kind == "config":
        (workdir / CHANGE).write_text(json.dumps(change))  # JSON is YAML
        stats = planned(workdir, (CONFIG, CHANGE))
    else:
        path, old, new = change
        with edited(workdir / path, old, new):
            stats = planned(workdir)
    assert stats == dict(Counter(expected)), f"{case}: expected {sorted(expected)}, got {stats}"


def test_the_changes_left_the_run_complete(workdir):
    """Every change was undone exactly: the run still has nothing to do (the matrix above relies on it)."""
    assert planned(workdir) == {}


# ---- provenance ----------------------------------------------------------------------------------


def _records(workdir: Path) -> dict[str, dict]:
    root = workdir / "results/provenance"
    return {
        p.relative_to(root).with_suffix("").as_posix(): json.loads(p.read_text())
        for p in sorted(root.rglob("*.json"))
        if p.name != "manifest.json"
    }


def _jobs(workdir: Path, *, plans: bool = True) -> list[str]:
    """The records a run of the fast config leaves (the report's aside), by rule[/wildcards]; without `plans`, those
    behind the report (no stage reads a memory plan: each plans for itself where it starts)."""
    key = next((workdir / "results/tokenized").iterdir()).name
    pairs_key = next((workdir / "results/tokenized_pairs").iterdir()).name
    reference = next((workdir / "results/preference/default").glob("reference-*")).name.removeprefix(
        "reference-"
    )
    base = next((workdir / "results/benchmark/base").iterdir()).name
    jobs = [
        "download",
        "conversations",
        "train_tokenizer",
        f"tokenize/{key}",
        "train/default",
        "preferences/best_vs_rest",
        f"tokenize_pairs/{pairs_key}",
        f"reference/default_{reference}",
        "dpo/default",
        "evaluate/default",
        "export/default_dpo",
        "export/default_sft",
        f"benchmark_base/{base}_builtin_choice",
        "benchmark/default_sft_builtin_choice",
        "benchmark/default_dpo_builtin_choice",
        "benchmark_gguf/default_sft_q4_k_m_builtin_choice",
        "benchmark_gguf/default_dpo_q4_k_m_builtin_choice",
    ]
    return jobs + (["plan/default", "plan_dpo/default", "plan_eval/default"] if plans else [])


def test_every_job_has_a_record(workdir):
    records = _records(workdir)
    assert sorted(records) == sorted([*_jobs(workdir), "report"])
    for name, rec in records.items():
        assert re.fullmatch(r"[0-9a-f]{16}", rec["code"] or ""), name  # every stage's params hash its code
        assert rec["start"] <= rec["end"] and rec["wall_s"] >= 0, name
        assert rec["host"]["hostname"] and rec["gpus"] == [], name  # CPU ranks here
        assert rec["software"]["python"] and rec["software"]["snakemake"], name
        assert rec["git"] is None, name  # the copy is not a git checkout
        for path, entry in {**rec["inputs"], **rec["outputs"]}.items():
            if entry["type"] == "file":
                assert entry["sha256"] == hashlib.sha256((workdir / path).read_bytes()).hexdigest(), path
            else:
                assert entry["type"] == "directory" and entry["files"], path
    # The stages of the Snakefile's world ran without torch (tests/test_layout.py checks their imports); the
    # evaluation scores models with it in its own process (the launchers of train, reference and dpo need it only
    # on a machine with GPUs: their ranks do the work); the GGUF files are scored by llama.cpp, without it
    # (tests/test_benchmark.py: the harness's path).
    light = {"download", "conversations", "train_tokenizer", "tokenize", "preferences", "tokenize_pairs", "plan",
             "plan_dpo", "plan_eval", "report", "benchmark_gguf"}  # fmt: skip
    for name, rec in records.items():
        assert not (rec["rule"] in light and rec["imported_torch"]), name
    assert records["evaluate/default"]["imported_torch"]
    train = records["train/default"]
    assert train["seeds"] == {"spec.train.seed": 1234}
    assert train["params"]["spec"]["train"]["learning_rate"] == 3.0e-3
    assert "config/deepspeed/zero2.json" in train["inputs"]
    assert records["download"]["seeds"] == {"spec.builtin.seed": 0}


def test_the_manifest_follows_the_records_back(workdir):
    manifest = json.loads((workdir / "results/provenance/manifest.json").read_text())
    jobs = manifest["jobs"]
    assert sorted(job["record"] for job in jobs) == sorted(
        f"results/provenance/{name}.json" for name in _jobs(workdir, plans=False)
    )
    # In pipeline order: every job comes after the jobs that wrote its inputs.
    written_by = {out: i for i, job in enumerate(jobs) for out in job["outputs"]}
    for i, job in enumerate(jobs):
        assert all(written_by.get(inp, -1) < i for inp in job["inputs"]), job["record"]
    assert {job["status"] for job in jobs} == {"ok"}
    assert manifest["missing"] == []
    assert "config/deepspeed/zero2.json" in manifest["sources"]
    assert not [src for src in manifest["sources"] if src.startswith("results/")]
    summary = manifest["summary"]
    assert summary["jobs"] == len(jobs) and summary["changed"] == []
    assert list(summary["git"]) == ["not a git checkout"]
    report = (workdir / "results/report/report.md").read_text()
    assert "### Jobs" in report
    for job in jobs:
        assert f"`{job['record']}`" in report, job["record"]
