"""Faults: a write that fails (disk full, permission denied) says which output and why, and leaves the previous
outputs as they were (a killed workflow: tests/test_faults.py).

Failing writes (`test_*_write*`): every kind of writer the stages use writes its outputs once, then
rewrites them with different content while writing fails, three ways:
- real ENOSPC: the outputs live on a 16 MiB tmpfs, mounted in a user and mount namespace of a child
  process (`unshare -Urm`, no privileges needed where user namespaces are enabled), and filled up;
- real EACCES: the output directories are made read-only (0555) and the writer runs in a user namespace
  without capabilities (`unshare --map-user`), where root's own files are subject to their mode bits as for
  any user (a plain chmod denies nothing to root, and CI runs as root);
- injected, in process (always runs, also where namespaces are not available): fsync fails with ENOSPC
  (a file system that reports a full disk late, as NFS and quotas do), and creating the temporary fails
  with EACCES.
Then the error must name the output and the cause, and every file under results/ must be byte for byte
what it was, with no temporary left (and the same rewrite without the fault must change the outputs, or
the check would prove nothing). `test_snakemake_job_on_a_full_disk` fills the disk under a Snakemake
job: there the failed job's own old outputs are gone (Snakemake deletes a job's outputs before it runs),
every other stage's are unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import FAST_CONFIG, REPO, RUN_TIMEOUT_S, TEMPORARY, snakemake_bin, temporaries, workflow_copy
from snaketune import io

TESTS_DIR = REPO / "tests"
WORKFLOW_DIR = REPO / "workflow"


def write_json_file(root: Path, version: int) -> list[Path]:
    """io.write_json, as the plan, provenance records, manifest, eval metrics and training summary use it."""
    out = root / "plan/default.json"
    io.write_json(out, {"experiment": "default", "version": version, "table": ["x" * 64] * (200 + version)})
    return [out]


def write_download(root: Path, version: int) -> list[Path]:
    """workflow/scripts/download.py: materialize into io.atomic_files (Parquet, SHA256SUMS, JSON)."""
    from snaketune.data.download import materialize

    raw = root / "data/raw"
    targets = [raw / "messages.parquet", raw / "SHA256SUMS", raw / "source.json"]
    with io.atomic_files(*targets) as (messages, _, _):
        materialize("builtin", messages.parent, builtin_trees=20, builtin_seed=version)
    return targets


def write_conversations(root: Path, version: int) -> list[Path]:
    """workflow/scripts/conversations.py: write_conversations into io.atomic_files."""
    from snaketune.data import conversations

    out = root / "data/conversations"
    targets = [out / "train.parquet", out / "validation.parquet", out / "stats.json"]
    result = conversations.build_conversations(
        conversations.read_messages(root / "data/raw/messages.parquet"),
        validation_fraction=0.2 + 0.1 * version,
    )
    with io.atomic_files(*targets) as (train, _, _):
        conversations.write_conversations(result, train.parent)
    return targets


def write_tokenizer(root: Path, version: int) -> list[Path]:
    """workflow/scripts/train_tokenizer.py: the tokenizers library's own writer, into io.atomic_files."""
    from snaketune.data import tokenizer

    out = root / "tokenizer/builtin"
    targets = [out / "tokenizer.json", out / "tokenizer_config.json"]
    texts = tokenizer.conversation_texts(root / "data/conversations/train.parquet")
    with io.atomic_files(*targets) as (tokenizer_json, _):
        tokenizer.train_tokenizer(texts, 300 + 20 * version, tokenizer_json.parent)
    return targets


def write_tokenized(root: Path, version: int) -> list[Path]:
    """snaketune.data.tokenization: datasets' Arrow writer inside io.atomic_dir."""
    from snaketune.data import tokenization

    out = root / "tokenized/0123456789abcdef"
    tokenization.tokenize_conversations(
        root / "data/conversations",
        root / "tokenizer/builtin",
        out,
        max_length=64 + 32 * version,
        packing=True,
        assistant_only_loss=True,
        chat_template="deepseek",
    )
    return [out]


def write_report(root: Path, version: int) -> list[Path]:
    """snaketune.report.build.build_report: matplotlib, HTML, Markdown and JSON into io.atomic_files."""
    from report_tree import make_results
    from snaketune.report import build as report

    inputs_root = root.parent / "report_inputs"  # the inputs are not under test: outside root
    inputs = make_results(inputs_root)
    inputs = dataclasses.replace(inputs, config={**inputs.config, "version": version})
    report.build_report(inputs, root / "report", workdir=inputs_root)
    return [root / "report" / name for name in report.OUTPUTS.values()]


WRITERS = (
    write_json_file,
    write_download,
    write_conversations,
    write_tokenizer,
    write_tokenized,
    write_report,
)
"""In dependency order: each writer reads what the ones before it wrote."""
WRITER_NAMES = [w.__name__ for w in WRITERS]
CAUSES = {"ENOSPC": "the file system is full", "EACCES": "permission denied"}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under root."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@contextlib.contextmanager
def disk_full(root: Path, targets: list[Path]) -> Iterator[None]:
    """Fill the (small, tmpfs) file system of root; real ENOSPC for every write until the filler is gone."""
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        yield
    finally:
        filler.unlink()


@contextlib.contextmanager
def read_only_dirs(root: Path, targets: list[Path]) -> Iterator[None]:
    """Mode 0555 on the directories of the targets: real EACCES for a process without capabilities."""
    dirs = sorted({t.parent for t in targets})
    modes = {d: d.stat().st_mode for d in dirs}
    for d in dirs:
        d.chmod(0o555)
    try:
        yield
    finally:
        for d, mode in modes.items():
            d.chmod(mode)


@contextlib.contextmanager
def fsync_reports_enospc(root: Path, targets: list[Path]) -> Iterator[None]:
    """Injected: the kernel reports the full disk only when the data is flushed (NFS, quotas)."""

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        yield


@contextlib.contextmanager
def temporaries_denied(root: Path, targets: list[Path]) -> Iterator[None]:
    """Injected: no file or directory may be created beside the outputs."""
    import tempfile

    def denied(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "mkstemp", denied)
        mp.setattr(tempfile, "mkdtemp", denied)
        yield


FAULTS = {
    "real_ENOSPC": disk_full,
    "real_EACCES": read_only_dirs,
    "injected_ENOSPC": fsync_reports_enospc,
    "injected_EACCES": temporaries_denied,
}


def fault_one_writer(writer: Callable[[Path, int], list[Path]], root: Path, fault: str) -> dict:
    """Write version 0, rewrite version 1 under the fault, then again without it; what happened, as JSON."""
    targets = writer(root, 0)
    before = snapshot(root)
    error = None
    with FAULTS[fault](root, targets):
        try:
            writer(root, 1)
        except Exception as e:
            error = {
                "type": type(e).__name__,
                "errno": io._errno(e),
                "message": "\n".join([str(e), *getattr(e, "__notes__", [])]),
                "notes": len(getattr(e, "__notes__", [])),
            }
    after = snapshot(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k, b"") != after.get(k, b""))
    writer(root, 1)
    return {
        "targets": [str(t) for t in targets],
        "error": error,
        "changed": changed,
        "temporaries": temporaries(root),
        "rewrite_changes_outputs": snapshot(root) != before,
    }


def fault_every_writer(fault: str, base: str) -> dict:
    """Every writer in turn under one fault, in one process (the entry point of the namespaced children)."""
    root = Path(base) / "results"
    root.mkdir(exist_ok=True)
    return {writer.__name__: fault_one_writer(writer, root, fault) for writer in WRITERS}


def _namespaces_work(*flags: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


CHILD_MARK = "FAULT RESULTS: "


def _in_child(prefix: list[str], fault: str, base: Path) -> dict:
    code = (
        f"import json, sys; sys.path[:0] = {[str(WORKFLOW_DIR), str(TESTS_DIR)]!r}; import test_write_faults; "
        f"print(test_write_faults.CHILD_MARK + json.dumps(test_write_faults.fault_every_writer({fault!r}, {str(base)!r})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKFLOW_DIR), str(TESTS_DIR)])}
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    marked = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    assert proc.returncode == 0 and marked, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return json.loads(marked[-1].removeprefix(CHILD_MARK))


@pytest.fixture(scope="module")
def real_enospc(tmp_path_factory) -> dict:
    if not _namespaces_work("--user", "--map-root-user", "--mount"):
        pytest.skip("user and mount namespaces are not available (unshare -Urm): no private tmpfs to fill")
    base = tmp_path_factory.mktemp("enospc")
    (base / "results").mkdir()
    # Mounted in the child's own mount namespace: gone with it, whatever happens.
    mount = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    script = 'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"'
    return _in_child([*mount, script, str(base / "results")], "real_ENOSPC", base)


@pytest.fixture(scope="module")
def real_eacces(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("eacces")
    if _namespaces_work("--user", "--map-user=1000", "--map-group=1000"):
        # No capabilities in the new user namespace, yet still the owner of what root made: mode bits apply.
        prefix = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    elif os.geteuid() != 0:
        prefix = []  # an ordinary user: a read-only directory denies it already
    else:
        pytest.skip("running as root without user namespaces: a read-only directory denies root nothing")
    return _in_child(prefix, "real_EACCES", base)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Every writer's outputs, version 0: the inputs each in-process test copies."""
    base = tmp_path_factory.mktemp("written")
    for writer in WRITERS:
        writer(base / "results", 0)
    return base


def check_outcome(outcome: dict, cause: str) -> None:
    error = outcome["error"]
    assert error is not None, f"the rewrite did not fail: {outcome}"
    # The error says, in one note, which outputs failed to be written and why...
    assert error["notes"] == 1, error["message"]
    for target in map(Path, outcome["targets"]):
        assert str(target.parent) in error["message"] and target.name in error["message"], error["message"]
    assert f"({CAUSES[cause]})" in error["message"], error["message"]
    assert error["errno"] == getattr(errno, cause), error
    # ...and nothing under results/ changed: old outputs byte-identical, no temporary or other file left.
    assert outcome["changed"] == [], outcome["changed"]
    assert outcome["temporaries"] == []
    assert outcome["rewrite_changes_outputs"], "the same rewrite without the fault changes nothing: no test"


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITER_NAMES)
def test_disk_full_write_keeps_the_previous_outputs(real_enospc, writer):
    check_outcome(real_enospc[writer], "ENOSPC")


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITER_NAMES)
def test_permission_denied_write_keeps_the_previous_outputs(real_eacces, writer):
    check_outcome(real_eacces[writer], "EACCES")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["injected_ENOSPC", "injected_EACCES"])
@pytest.mark.parametrize("writer", WRITER_NAMES)
def test_injected_write_failure_keeps_the_previous_outputs(written, tmp_path, writer, fault):
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)
    outcome = fault_one_writer(
        dict(zip(WRITER_NAMES, WRITERS, strict=True))[writer], tmp_path / "results", fault
    )
    check_outcome(outcome, fault.removeprefix("injected_"))


def test_a_kill_leaves_only_temporaries_that_the_next_write_removes(tmp_path):
    """A writer killed before its rename leaves its temporary; the next write of that output removes it
    (the e2e kills above check the same through Snakemake)."""
    out = tmp_path / "a.json"
    io.write_json(out, {"v": 0})
    stale = [tmp_path / ".a.json.abcd1234.tmp", tmp_path / ".a.json.x1.old"]
    stale[0].write_text("partial")
    stale[1].mkdir()
    (tmp_path / ".b.json.abcd1234.tmp").write_text("someone else's")
    io.write_json(out, {"v": 1})
    assert json.loads(out.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.json.abcd1234.tmp", "a.json"]


# ---- a full disk under Snakemake ---------------------------------------------------------------------

TOKENIZER_TARGET = "results/tokenizer/builtin/tokenizer.json"


def snakemake_on_a_full_disk(workdir: str) -> dict:
    """With results/ on a small tmpfs (the caller mounts it): run the data stages up to the tokenizer, fill
    the disk, ask for ten times the data (the download job keeps its old outputs while it runs, update() in
    data.smk, and the new ones need more), free the disk, rerun with the first config. The entry point of the
    namespaced child of test_snakemake_job_on_a_full_disk."""
    wd = Path(workdir)

    bigger = wd / "bigger.yaml"
    bigger.write_text("dataset: {builtin_trees: 1500}\n")

    def run(*args: str, configs: tuple[Path, ...] = ()) -> dict:
        proc = subprocess.run(
            # --configfile takes several files: it comes last.
            [
                str(snakemake_bin()),
                *args,
                "--cores",
                "2",
                "--configfile",
                str(FAST_CONFIG),
                *map(str, configs),
            ],
            cwd=wd,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        return {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}

    first = run(TOKENIZER_TARGET)
    before = snapshot(wd / "results")
    with disk_full(wd / "results", []):
        failed = run(TOKENIZER_TARGET, configs=(bigger,))
    during = snapshot(wd / "results")
    log = wd / "logs/download.log"
    failed_log = log.read_text() if log.exists() else ""
    again = run(TOKENIZER_TARGET)
    after = snapshot(wd / "results")
    return {
        "first": first,
        "failed": failed,
        "failed_log": failed_log,
        "changed_by_failure": sorted(
            k for k in before.keys() | during.keys() if before.get(k, b"") != during.get(k, b"")
        ),
        "temporaries_during": [k for k in during if TEMPORARY.match(Path(k).name)],
        "again": again,
        "differ_after_rerun": sorted(
            k
            for k in before.keys() | after.keys()
            if before.get(k, b"") != after.get(k, b"") and not k.startswith("provenance/")
        ),
    }


@pytest.mark.slow  # three Snakemake runs
def test_snakemake_job_on_a_full_disk(tmp_path_factory):
    """Real ENOSPC through Snakemake: the failing job says which outputs and why, its old outputs and their
    provenance record stay as they were (update() in data.smk, snaketune.backups: restored without a byte of
    space), nothing else under results/ changes, and once there is space a plain rerun of the first config has
    nothing to do."""
    if not _namespaces_work("--user", "--map-root-user", "--mount"):
        pytest.skip("user and mount namespaces are not available (unshare -Urm): no private tmpfs to fill")
    workdir = workflow_copy(tmp_path_factory, "faults_full_disk")
    (workdir / "results").mkdir()
    code = (
        f"import json, sys; sys.path[:0] = {[str(WORKFLOW_DIR), str(TESTS_DIR)]!r}; import test_write_faults; "
        f"print(test_write_faults.CHILD_MARK + json.dumps(test_write_faults.snakemake_on_a_full_disk({str(workdir)!r})))"
    )
    script = 'mount -t tmpfs -o size=8m tmpfs "$0" && exec "$@"'
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(workdir / "results")]
        + [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=3 * RUN_TIMEOUT_S,
    )
    marked = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_MARK)]
    assert proc.returncode == 0 and marked, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    out = json.loads(marked[-1].removeprefix(CHILD_MARK))
    assert out["first"]["returncode"] == 0, out["first"]["output"][-3000:]
    failed = out["failed"]
    assert failed["returncode"] != 0, failed["output"][-3000:]
    # On the terminal, through Snakemake's error report: the rule, the error, the outputs and the cause.
    line = re.search(r"ERROR in rule download: .*", failed["output"])
    assert line, failed["output"][-4000:]
    assert "results/data/raw/{messages.parquet, SHA256SUMS, source.json}" in line.group(0), line.group(0)
    assert "(the file system is full)" in line.group(0) and "28" in line.group(0), line.group(0)
    assert "(the file system is full)" in out["failed_log"]  # and in the job's log, with the traceback
    # Nothing under results/ changed: the failed job's own outputs and record are kept, no temporary is left.
    assert "Restored previous version of results/data/raw/messages.parquet" in failed["output"]
    assert out["changed_by_failure"] == [], out["changed_by_failure"]
    assert out["temporaries_during"] == []
    again = out["again"]
    assert again["returncode"] == 0, again["output"][-3000:]
    assert re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", again["output"]) == []
    assert out["differ_after_rerun"] == [], out["differ_after_rerun"]
