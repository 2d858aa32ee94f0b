"""snaketune.verify on small files: an output is checked by its content, not its size; the quick check hashes only what
something wrote since; the stages refuse changed caches; Snakemake's update() backups keep the last good outputs as
they were (snaketune.backups). The workflow's own runs: tests/test_kept_outputs.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import zero
from snaketune import backups, verify
from snaketune.io import hash_files, sha256_file


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def output_dir(root: Path = Path("results/tokenized/k")) -> Path:
    (root / "train").mkdir(parents=True)
    (root / "train" / "data.arrow").write_bytes(os.urandom(200_000))
    (root / "stats.json").write_text('{"rows": 87}')
    (root / ".snakemake_timestamp").write_text("")
    return root


def record(out: Path, rule: str = "tokenize") -> dict:
    return {"rule": rule, "end": "2026-12-07T00:00:00Z", "outputs": {out.as_posix(): verify.describe(out)}}


def test_bytes_zeroed_at_the_same_size_are_found(workdir):
    out = output_dir()
    entry = verify.describe(out)
    assert verify.compare(out, entry) == []
    zero(out / "train/data.arrow", 4096, 65536)
    (found,) = verify.compare(out, entry)
    assert found.startswith("results/tokenized/k/train/data.arrow: content differs at the recorded size"), (
        found
    )


def test_the_quick_check_trusts_an_unwritten_file_and_verify_does_not(workdir):
    """Bytes changed with the mtime put back (bit rot, a copy that kept mtimes): the quick check, which hashes only
    files written since their record, passes; the full check finds them."""
    out = output_dir()
    entry = verify.describe(out)
    zero(out / "train/data.arrow", 0, 100, keep_mtime=True)
    assert verify.compare(out, entry) == []
    assert len(verify.compare(out, entry, full=True)) == 1


def test_missing_and_extra_files_are_named_without_bytes_for_a_missing_one(workdir):
    out = output_dir()
    entry = verify.describe(out)
    (out / "stats.json").unlink()
    (out / "extra.bin").write_bytes(b"12345")
    assert verify.compare(out, entry) == [
        "results/tokenized/k/extra.bin: not in the record (5 bytes)",
        "results/tokenized/k/stats.json: missing, recorded 12 bytes",
    ]
    assert verify.compare("results/nothing", entry) is None


def test_a_touched_file_is_hashed_once(workdir, monkeypatch):
    """Snakemake touches a job's file outputs after the job: their mtime is not the recorded one. The first check
    hashes such a file and remembers it; the next trusts it until its size or mtime moves again."""
    out = Path("results/data/stats.json")
    out.parent.mkdir(parents=True)
    out.write_text("{}")
    entry = verify.describe(out)
    os.utime(out, ns=(time.time_ns(), entry["mtime_ns"] + 10**9))
    hashed = []
    real = verify.hash_files
    monkeypatch.setattr(verify, "hash_files", lambda paths, threads=None: hashed.extend(paths) or real(paths))
    verified: dict = {}
    assert verify.compare(out, entry, verified=verified) == []
    assert verify.compare(out, entry, verified=verified) == []
    assert hashed == ["results/data/stats.json"]
    out.write_text("{}")  # written again: hashed again
    assert verify.compare(out, entry, verified=verified) == []
    assert hashed == ["results/data/stats.json"] * 2


def test_preflight_refuses_a_changed_output_with_the_command_that_rebuilds_it(workdir):
    out = output_dir()
    records = {"results/provenance/tokenize/k.json": record(out)}
    assert verify.preflight(records, [out.as_posix()], lambda p: True) == []
    zero(out / "train/data.arrow", 0, 10)
    with pytest.raises(verify.OutputsChanged) as e:
        verify.preflight(records, [out.as_posix()], lambda p: True)
    assert "remove it (rm -r results/tokenized/k) and the next run rebuilds it and what follows" in str(
        e.value
    )


def test_preflight_returns_missing_current_outputs_only(workdir):
    """A missing output of a job the config runs is returned (rule all asks for it); one of another config's record
    (an old cache key) or one no rule makes any more is not: removing it must not start a job."""
    current, old, gone = (
        output_dir(),
        output_dir(Path("results/tokenized/old")),
        output_dir(Path("results/x")),
    )
    records = {
        "a.json": record(current),
        "b.json": record(old),
        "c.json": record(gone, rule="removed"),
    }
    for d in (current, old, gone):
        for f in sorted(d.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        d.rmdir()
    missing = verify.preflight(records, [current.as_posix(), gone.as_posix()], lambda p: p != gone.as_posix())
    assert missing == [current.as_posix()]


def test_a_stage_refuses_a_changed_cache_before_it_reads_it(workdir):
    """Even when nothing announced the change (mtime kept), a stage hashes a small cache it reads; a large input is
    checked quickly (sizes and mtimes), so its hash costs nothing at each stage."""
    out = output_dir()
    records = {"results/provenance/tokenize/k.json": record(out)}
    verify.check_inputs([out.as_posix(), "config/other.json"], records)
    zero(out / "train/data.arrow", 0, 10, keep_mtime=True)
    with pytest.raises(verify.OutputsChanged, match=r"rm -r results/tokenized/k"):
        verify.check_inputs([out.as_posix()], records)
    verify.check_inputs([out.as_posix()], records, limit=1000)  # above the limit: the quick check passes


def test_verify_hashes_every_current_output(workdir):
    out, other = output_dir(), output_dir(Path("results/tokenized/old"))
    records = {"a.json": record(out), "b.json": record(other)}
    zero(out / "stats.json", 0, 1, keep_mtime=True)
    zero(other / "stats.json", 0, 1, keep_mtime=True)  # another config's output: not checked
    result = verify.verify(records, [out.as_posix()], threads=2)
    assert result["checked"] == 1 and result["files"] == 2 and result["missing"] == []
    assert (
        len(result["changed"]) == 1
        and "results/tokenized/k/stats.json: content differs" in result["changed"][0]
    )


def test_hashing_in_parallel_gives_each_files_sha256(tmp_path):
    files = []
    for i in range(5):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(os.urandom(1000 * (i + 1)))
    assert hash_files([str(f) for f in files], threads=3) == {str(f): sha256_file(f) for f in files}


# ---- the last good outputs: Snakemake's update() backups as hard links --------------------------------------------


class Persistence:
    """Snakemake's persistence object as FileBackupMixin sees it: backups under <path>/backups."""

    def __init__(self, path: Path):
        self.path = path

    def _read_record(self, key: str):
        return None

    _get_backup_path = backups.FileBackupMixin._get_backup_path
    _backup_path = backups.FileBackupMixin._backup_path


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_failed_job_gets_its_outputs_back_as_they_were(workdir, kind):
    """What Snakemake calls around a job with update() outputs: backup before, restore when it failed. The restored
    output has its old bytes, and its old mtimes (a copy would give new ones and rerun what follows). A job that
    replaced the output before failing gets the old one back too."""
    out = output_dir() if kind == "directory" else Path("results/raw/messages.parquet")
    if kind == "file":
        out.parent.mkdir(parents=True)
        out.write_bytes(b"old")
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in [out, *out.rglob("*")] if f.is_file()}
    persistence = Persistence(workdir / ".snakemake")
    for replaced in (False, True):
        (workdir / ".snakemake/backups" / out).parent.mkdir(parents=True, exist_ok=True)
        backups.backup_output(persistence, out)
        backups.backup_output(persistence, out)  # a backup left by a killed run is replaced
        if replaced:  # what an atomic writer does: a new file or tree renamed over the old
            new = out.with_name(out.name + ".new")
            if kind == "file":
                new.write_bytes(b"new")
            else:
                new.mkdir()
                shutil.rmtree(out)
            os.replace(new, out)
        assert backups.restore_output(persistence, out)
        after = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in [out, *out.rglob("*")] if f.is_file()}
        assert after == before, replaced
        assert not (workdir / ".snakemake/backups" / out).exists()


def test_a_backup_costs_no_copy(workdir):
    out = output_dir()
    backups.backup_output(Persistence(workdir / ".snakemake"), out)
    kept = workdir / ".snakemake/backups" / out / "train/data.arrow"
    assert os.path.samefile(kept, out / "train/data.arrow")


def test_installed_into_snakemake():
    backups.install()
    from snakemake.persistence import FileBackupMixin

    assert FileBackupMixin.backup_output is backups.backup_output
    assert FileBackupMixin.restore_output is backups.restore_output
