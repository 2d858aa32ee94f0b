"""snaketune.provenance: per-job records and the manifest that follows them back from the report's inputs.

The real workflow's records are checked in tests/test_reproducibility.py; here a stand-in for the
`snakemake` object of a script drives record() directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from snaketune import provenance

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_" + "abcdefghijklmnopqrstuvwxyz0123"


class Named(list):
    """Like Snakemake's Namedlist: a list of values that also maps names to them."""

    def __init__(self, **named):
        super().__init__()
        self._named = named
        for value in named.values():
            self.extend(value if isinstance(value, list) else [value])
        for name, value in named.items():
            setattr(self, name, value)

    def items(self):
        return self._named.items()


class FakeSnakemake:
    def __init__(self, rule, *, inputs=None, outputs=None, params=None, wildcards=None, log=None):
        self.rule = rule
        self.input = Named(**(inputs or {}))
        self.output = Named(**(outputs or {}))
        self.params = Named(**(params or {}))
        self.wildcards = Named(**(wildcards or {}))
        self.log = Named(**({"log": log} if log else {}))
        self.resources = Named(_cores=2, gpu=3, tmpdir="/tmp")
        self.threads = 2


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Jobs run in the workflow's working directory, where results/ lives."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: str, data: bytes = b"x") -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    return path


def test_record_paths():
    assert provenance.record_path("download", {}) == Path("results/provenance/download.json")
    assert provenance.record_path("train", {"experiment": "lora"}) == Path(
        "results/provenance/train/lora.json"
    )


def test_record_holds_hashes_params_environment_and_times(workdir):
    write("results/a.parquet", b"abc")
    write("results/tok/train/part.arrow", b"1234")
    write("results/tok/stats.json", b"{}")
    write("results/tok/.snakemake_timestamp", b"")  # Snakemake's, not the job's
    write("results/out.json", b"{}")
    params = {"spec": {"train": {"seed": 7, "lr": 0.1}, "builtin_seed": 3, "code": "0123456789abcdef"}}
    smk = FakeSnakemake(
        "train",
        inputs={"conv": "results/a.parquet", "data": "results/tok", "ds": write("config/z.json", b"{}")},
        outputs={"summary": "results/out.json"},
        params=params,
        wildcards={"experiment": "default"},
        log="logs/train/default.log",
    )
    path = provenance.record(smk, 1000.0, 1012.5)
    assert path == Path("results/provenance/train/default.json")
    rec = json.loads(path.read_text())
    assert rec["rule"] == "train" and rec["wildcards"] == {"experiment": "default"}
    mtime = Path("results/a.parquet").stat().st_mtime_ns  # lets a later check skip hashing an unwritten file
    assert rec["inputs"]["results/a.parquet"] == {
        "type": "file",
        "sha256": sha(b"abc"),
        "bytes": 3,
        "mtime_ns": mtime,
    }
    tree = rec["inputs"]["results/tok"]
    assert tree["type"] == "directory" and sorted(tree["files"]) == ["stats.json", "train/part.arrow"]
    assert tree["sha256"] == sha(f"stats.json\0{sha(b'{}')}\ntrain/part.arrow\0{sha(b'1234')}\n".encode())
    assert rec["outputs"]["results/out.json"]["sha256"] == sha(b"{}")
    assert rec["params"] == params and rec["code"] == "0123456789abcdef"
    assert rec["seeds"] == {"spec.train.seed": 7, "spec.builtin_seed": 3}
    assert rec["start"] == "1970-01-01T00:16:40.000Z" and rec["wall_s"] == 12.5
    assert rec["resources"] == {"gpu": 3} and rec["threads"] == 2
    assert (
        rec["software"]["python"]
        == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    )
    assert rec["software"]["snakemake"] != "not installed"
    assert rec["host"]["hostname"] and isinstance(rec["gpus"], list)
    assert set(rec["env"]) <= set(provenance.ENV_RECORDED)


def test_tokens_never_reach_a_record(workdir, monkeypatch):
    for name in provenance.ENV_RECORDED:  # an earlier test or the CI machine may set some of them
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MY_SERVICE_SECRET", "s3cr3t-value-123")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded: it changes how a job computes
    other = "hf_" + "ZYXWVUTSRQPONMLKJIHGFEDCBA987"  # shaped like a token, in no variable
    smk = FakeSnakemake(
        "fetch_tokenizer",
        outputs={"tok": write("results/tok.json")},
        params={"spec": {"name": f"repo?token={TOKEN}", "note": "s3cr3t-value-123", "other": other}},
        wildcards={"tokenizer": "x"},
    )
    text = provenance.record(smk, 0.0, 1.0).read_text()
    for secret in (TOKEN, "s3cr3t-value-123", other):
        assert secret not in text
    rec = json.loads(text)
    assert rec["params"]["spec"]["name"] == "repo?token=<redacted HF_TOKEN>"
    assert rec["env"] == {"OMP_NUM_THREADS": "1"}


def test_git_state(tmp_path):
    assert provenance.git_state(tmp_path) is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], cwd=tmp_path, check=True)
    state = provenance.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "f").write_text("2")
    assert provenance.git_state(tmp_path)["dirty"] is True


def _job(rule, start, inputs, outputs, wildcards=None):
    smk = FakeSnakemake(
        rule,
        inputs={f"i{n}": p for n, p in enumerate(inputs)},
        outputs={f"o{n}": write(p, rule.encode()) for n, p in enumerate(outputs)},
        params={"code": rule},
        wildcards=wildcards,
    )
    return provenance.record(smk, start, start + 1)


def test_manifest_follows_records_back_from_the_targets(workdir):
    write("config/ds.json")
    _job("download", 1, [], ["results/raw.parquet"])
    _job("tokenize", 2, ["results/raw.parquet"], ["results/tok/data.arrow"])
    _job("train", 3, ["results/tok/data.arrow", "config/ds.json", "results/plan.json"], ["results/model.bin"])
    _job("stale", 4, [], ["results/old.bin"])  # an experiment no longer configured: not behind the targets
    manifest = provenance.build_manifest(["results/model.bin"])
    assert [j["rule"] for j in manifest["jobs"]] == ["download", "tokenize", "train"]
    assert {j["status"] for j in manifest["jobs"]} == {"ok"}
    assert manifest["missing"] == ["results/plan.json"]  # under results/ but no record: made before records
    assert manifest["sources"] == {"config/ds.json": {"type": "file", "sha256": sha(b"x"), "bytes": 1}}
    assert manifest["summary"]["seeds"] == {} and manifest["summary"]["jobs"] == 3

    write("results/tok/data.arrow", b"edited by hand")
    manifest = provenance.build_manifest(["results/model.bin"])
    assert [j["status"] for j in manifest["jobs"]] == ["ok", "changed", "ok"]
    assert manifest["summary"]["changed"] == ["tokenize"]


def test_write_manifest(workdir):
    _job("train", 1, [], ["results/model.bin"], {"experiment": "a"})
    out = workdir / provenance.MANIFEST
    manifest = provenance.write_manifest(["results/model.bin"], out)
    assert json.loads(out.read_text()) == manifest
    assert manifest["jobs"][0]["record"] == "results/provenance/train/a.json"
    # The manifest lies among the records but is never read as one.
    assert list(provenance.load_records()) == ["results/provenance/train/a.json"]


@pytest.fixture
def stage(monkeypatch):
    """workflow/scripts/_stage.py, with the stderr and logging it redirects put back afterwards."""
    monkeypatch.syspath_prepend(str(REPO / "workflow" / "scripts"))
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    import _stage

    yield _stage
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_stage_replaces_the_record_only_after_success(workdir, stage):
    out = write("results/out.json")
    smk = FakeSnakemake(
        "download", outputs={"o": out}, params={"code": "c"}, log=write("logs/download.log", b"")
    )
    stage.run(smk, lambda s: None)
    path = Path("results/provenance/download.json")
    assert path.exists()

    def fail(s):
        raise RuntimeError("boom")

    with pytest.raises(SystemExit):
        stage.run(smk, fail)
    # Its outputs kept (a rule with update() outputs: snaketune.backups), the record that describes them stays...
    assert path.exists()
    Path(
        out
    ).unlink()  # ...but where Snakemake removed them before the job (every other rule), it goes: a failed
    with pytest.raises(SystemExit):  # run leaves no record describing the outputs of an earlier one
        stage.run(smk, fail)
    assert not path.exists()


def test_stage_keeps_the_outputs_when_the_record_fails(workdir, stage, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(provenance, "record", broken)
    log = write("logs/download.log", b"")
    smk = FakeSnakemake("download", outputs={"o": write("results/out.json")}, params={"code": "c"}, log=log)
    stage.run(smk, lambda s: None)  # no SystemExit: the job succeeds
    assert "provenance record not written" in Path(log).read_text()


def test_the_report_lists_the_manifest_jobs(tmp_path):
    """The report's provenance section and summary.json show each job of the manifest, and say when
    versions differ between jobs, an output changed after its record, or a file has no record."""
    import dataclasses

    from report_tree import make_results
    from snaketune.report import build as report

    def job(rule, wildcards, torch, status):
        return {
            "record": provenance.record_path(rule, wildcards).as_posix(),
            "status": status,
            "rule": rule,
            "wildcards": wildcards,
            "start": "2026-11-29T10:00:00.000Z",
            "end": "2026-11-29T10:00:12.000Z",
            "wall_s": 12.0,
            "seeds": {},
            "host": {"hostname": "node1"},
            "gpus": ["NVIDIA H200"] if rule == "train" else [],
            "code": "0123456789abcdef",
            "software": {"torch": torch},
            "git": None,
        }

    jobs = [job("download", {}, "2.13.0", "ok"), job("train", {"experiment": "default"}, "2.12.0", "changed")]
    manifest = {"jobs": jobs, "missing": ["results/plan/default.json"], "summary": provenance.summarize(jobs)}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    inputs = dataclasses.replace(make_results(tmp_path), manifest=path)
    summary = report.build_report(inputs, tmp_path / "out", workdir=tmp_path)
    prov = summary["provenance"]
    assert [j["job"] for j in prov["jobs"]] == ["download", "train[default]"]
    assert prov["job_software"] == {"torch": {"2.13.0": ["download"], "2.12.0": ["train[default]"]}}
    md = (tmp_path / "out/report.md").read_text()
    assert "### Jobs" in md
    assert "| `train[default]` | 2026-11-29 10:00:00 | 12.0 s | node1 | NVIDIA H200 |" in md
    assert "**changed**" in md and "`torch` differs between jobs" in md
    assert "No provenance record for `results/plan/default.json`" in md
