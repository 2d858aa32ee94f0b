"""What the workflow tells a user to do works, and nothing is lost (issue #51), on copies of the shared tiny run
(conftest.tiny_run): a changed output is refused with a command that rebuilds it, and that command, then the plain
run, rebuilds it and what follows; a corrupted cache is found by its content, at the same size, by the run, by the
stage that reads it or by `verify`; a stage that fails leaves the last good outputs as they were (bytes, mtimes and
records), so that undoing the cause reruns nothing. Unit checks: tests/test_verify.py."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import Result, clone_run, dry_run, job_stats, snakemake, zero

pytestmark = pytest.mark.slow  # copies of the shared tiny workflow run

ARGS = ("--cores", "2", "--resources", "gpu=2", "--configfile", "tiny.yaml")


def attempt(workdir: Path, *args: str) -> Result:
    """conftest.snakemake, its exit code and output kept whatever they are (these tests read failures)."""
    return snakemake(workdir, *args, check=False, timeout=900)


def tree(workdir: Path, top: str = "results") -> dict[str, tuple[str, int]]:
    """Every file under `top`: (sha256, mtime_ns)."""
    return {
        p.relative_to(workdir).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted((workdir / top).rglob("*"))
        if p.is_file()
    }


def tokenized(workdir: Path) -> Path:
    (key,) = (workdir / "results/tokenized").iterdir()
    return key


def advised(output: str) -> list[str]:
    """The commands a refusal gives: `rm -r <output>` for each changed output."""
    return re.findall(r"\(rm -r ([^)]+)\)", output)


# ---- advice that works -------------------------------------------------------------------------------------------


def test_deleted_weights_are_refused_and_the_advice_rebuilds_them(tiny_run, tmp_path):
    """The DPO model's weights deleted: the run refuses, naming the file as missing; after exactly the advised
    command, the plain run rebuilds the model and what follows (Snakemake alone said "Nothing to be done")."""
    w = clone_run(tiny_run, tmp_path / "w")
    (w / "results/dpo/default/model/model.safetensors").unlink()
    code, out = dry_run(w, ARGS)
    assert code != 0 and "results/dpo/default/model/model.safetensors: missing, recorded" in out, out[-3000:]
    assert advised(out) == ["results/dpo/default/model"], out[-3000:]
    subprocess.run(["sh", "-c", f"rm -r {shlex.quote(advised(out)[0])}"], cwd=w, check=True)
    code, out = dry_run(w, ARGS)
    assert code == 0, out[-3000:]
    stats = job_stats(out)
    assert {"dpo", "evaluate", "export", "report"} <= set(stats) and "train" not in stats, stats


def test_a_zeroed_cache_is_found_by_its_content_and_rebuilt(tiny_run, tmp_path):
    """4 KB of the tokenized Arrow file zeroed, its size unchanged: refused, naming the file and that its content
    differs; the advised command and the plain run rebuild the cache and what trained on it."""
    w = clone_run(tiny_run, tmp_path / "w")
    key = tokenized(w)
    arrow = next((key / "train").glob("*.arrow"))
    zero(arrow, 4096, 4096)
    code, out = dry_run(w, ARGS)
    rel = arrow.relative_to(w).as_posix()
    assert code != 0 and f"{rel}: content differs at the recorded size" in out, out[-3000:]
    assert advised(out) == [key.relative_to(w).as_posix()]
    shutil.rmtree(w / advised(out)[0])
    code, out = dry_run(w, ARGS)
    assert code == 0 and {"tokenize", "train", "dpo", "evaluate", "report"} <= set(job_stats(out)), out[
        -3000:
    ]


def test_the_plain_run_rebuilds_a_removed_output_and_what_follows(tiny_run, tmp_path):
    """For real, on the cheapest stage whose consumer is up to date: the evaluation's metrics removed, a plain run
    makes them again (to the same figures) and the report after them; then nothing is left to do."""
    w = clone_run(tiny_run, tmp_path / "w")
    metrics = w / "results/eval/default/metrics.json"
    before = json.loads(metrics.read_text())
    report = (w / "results/report/index.html").stat().st_mtime_ns
    metrics.unlink()
    run = attempt(w, *ARGS)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "results/eval/default/metrics.json is missing" in run.stderr
    assert re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", run.stderr) == [
        "evaluate",
        "manifest",
        "report",
        "all",
    ]
    assert json.loads(metrics.read_text())["validation"] == before["validation"]
    assert (w / "results/report/index.html").stat().st_mtime_ns > report
    code, out = dry_run(w, ARGS)
    assert code == 0 and job_stats(out) == {}, out[-3000:]


# ---- what no write announced: the stage that reads it, and verify -----------------------------------------------


def test_verify_and_the_reading_stage_find_what_the_quick_check_trusts(tiny_run, tmp_path):
    """Bytes changed with the mtime put back (bit rot, a copy that kept mtimes): the run's quick check trusts the
    file; `snakemake verify` hashes every output and names it with the command that rebuilds it; a stage that
    reads the cache refuses it before it starts (and keeps its own outputs)."""
    w = clone_run(tiny_run, tmp_path / "w")
    clean = attempt(w, "--cores", "2", "verify", "--configfile", "tiny.yaml")
    assert clean.returncode == 0 and re.search(r"verify: \d+ outputs, \d+ files", clean.stderr), clean.stderr[
        -3000:
    ]
    key = tokenized(w)
    arrow = next((key / "train").glob("*.arrow"))
    zero(arrow, 1024, 512, keep_mtime=True)
    code, out = dry_run(w, ARGS)
    assert code == 0 and job_stats(out) == {}, out[-3000:]
    found = attempt(w, "--cores", "2", "verify", "--configfile", "tiny.yaml")
    rel = arrow.relative_to(w).as_posix()
    assert found.returncode != 0 and f"{rel}: content differs at the recorded size" in found.stderr
    assert advised(found.stderr) == [key.relative_to(w).as_posix()], found.stderr[-3000:]
    export = tree(w, "results/export/default/sft")
    forced = attempt(w, *ARGS, "--forcerun", "results/export/default/sft")
    assert forced.returncode != 0, forced.stderr[-3000:]
    assert re.search(r"ERROR in rule export: OutputsChanged: inputs changed since", forced.stderr)
    assert f"rm -r {key.relative_to(w).as_posix()}" in forced.stderr
    assert tree(w, "results/export/default/sft") == export


# ---- a failed stage keeps the last good data ---------------------------------------------------------------------


def sabotaged(script: Path) -> None:
    """The stage fails where it starts: its script raises before the stage's function runs."""
    text = script.read_text()
    script.write_text(
        text.replace("def main(smk):\n", "def main(smk):\n    raise RuntimeError('injected')\n", 1)
    )


def test_a_failed_stage_keeps_the_last_good_outputs(tiny_run, tmp_path):
    """download (a record that cannot be read), conversations (a filter that keeps nothing), tokenize and export
    (a failure injected into the stage) each fail in turn; after each, every file under results/ has the bytes and
    the mtime it had (the failed job's own outputs, its provenance record and all the others), and once the cause
    is undone the plain run has nothing to do."""
    w = clone_run(tiny_run, tmp_path / "w")
    before = tree(w)
    records = pq.read_table(w / "results/data/raw/messages.parquet").to_pylist()
    records[2]["text"] = ["a list", "is not text"]
    (w / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (w / "bad-source.yaml").write_text("dataset: {source: bad.jsonl}\n")
    (w / "no-language.yaml").write_text("dataset: {languages: [xx]}\n")
    failures = {
        "download": ("bad-source.yaml", None),
        "conversations": ("no-language.yaml", None),
        "tokenize": (None, "tokenize_data.py"),
        "export": (None, "export.py"),
    }
    for rule, (overlay, script) in failures.items():
        saved = tmp_path / "saved.py"
        if script:
            shutil.copy2(w / "workflow/scripts" / script, saved)
            sabotaged(w / "workflow/scripts" / script)
        run = attempt(w, *ARGS, *([overlay] if overlay else []), "--keep-going")
        if script:
            shutil.copy2(saved, w / "workflow/scripts" / script)  # back, with its old mtime
        assert run.returncode != 0 and f"ERROR in rule {rule}:" in run.stderr, (rule, run.stderr[-4000:])
        assert "Restored previous version" in run.stderr, (rule, run.stderr[-4000:])
        after = tree(w)
        assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == set(), rule
        if (
            overlay
        ):  # the kept outputs are the old settings', not the failed job's: the same settings run it again
            code, out = dry_run(w, (*ARGS, overlay))
            assert code == 0 and rule in job_stats(out), (rule, out[-3000:])
    code, out = dry_run(w, ARGS)
    assert code == 0 and job_stats(out) == {}, out[-3000:]
