"""A failed job's last good outputs kept in place: Snakemake's update() outputs, backed up as hard links.

Snakemake deletes a job's outputs before the job runs (snakemake 9.27, jobs.py `Job.remove_existing_output`), so a
stage that fails would leave none, whatever its own atomic writes keep. Outputs flagged `update()` are the
exception: Snakemake leaves them in place while the job runs, backs them up first (`Job.prepare`) and restores the
backup when the job fails (`Job.postprocess`, `FileBackupMixin.restore_output`). The rules whose data the docs promise
to keep flag their outputs so (data.smk, preference.smk, export.smk).

Snakemake records a job's params and inputs as the metadata of its outputs even when the job failed
(`Job.postprocess` calls `persistence.finished` for failed jobs too): restored outputs would then pass for the failed
job's, so that the next run with the same settings would not run it again and the stages after it would read the
old data as new. The restore therefore also puts back the outputs' metadata as it was before the job (`finished`).

Snakemake's own backup is a full copy (`shutil.copytree`: the GGUF files of a 7B are 25 GB) and its restore a
second copy, which gives a restored file a new mtime and so reruns every stage after it; its backup of a directory
also fails when a killed run left one behind (`copytree` onto an existing directory). Every stage here replaces its
outputs by renames (snaketune.io) and never writes into an existing file, so a hard link keeps a file's old content
as well as a copy does: `install` makes the backup a tree of hard links (copies where the file system refuses a
link), and the restore a rename, or nothing where the job left the old files themselves in place, so restored files
keep their mtimes. The Snakefile installs it before any job runs (common.smk).
"""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

from snakemake.persistence import FileBackupMixin, PersistenceBase

_FINISHED = PersistenceBase.finished


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused: a copy keeps the content as well
        shutil.copy2(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _files(path: Path) -> dict[str, Path]:
    if path.is_file():
        return {"": path}
    return {f.relative_to(path).as_posix(): f for f in path.rglob("*") if f.is_file()}


def _same(path: Path, backup: Path) -> bool:
    """Whether `path` still is the backed-up output: the same files, each the same inode or (a copy, where results/
    and .snakemake/ lie on two file systems) the same bytes. Then nothing is moved: no space is needed on a full disk
    and the files keep their mtimes."""
    if not path.exists() or path.is_dir() != backup.is_dir():
        return False
    now, kept = _files(path), _files(backup)
    return now.keys() == kept.keys() and all(
        os.path.samefile(now[k], kept[k]) or filecmp.cmp(now[k], kept[k], shallow=False) for k in now
    )


def _state(persistence) -> tuple[dict, set]:
    """(output -> its metadata record before the job, outputs restored) of a persistence object."""
    return persistence.__dict__.setdefault("_snaketune_kept", ({}, set()))


def backup_output(self, path: Path) -> None:
    backup = self._get_backup_path(path)
    backup.parent.mkdir(parents=True, exist_ok=True)
    _remove(backup)  # left by a killed run
    if path.is_dir():
        shutil.copytree(path, backup, copy_function=_link_or_copy, symlinks=True)
    else:
        _link_or_copy(str(path), str(backup))
    _state(self)[0][str(path)] = self._read_record(str(path))  # a local output's key is its path


def restore_output(self, path: Path) -> bool:
    backup = self._get_backup_path(path)
    if not backup.exists():
        return False
    if _same(path, backup):
        _remove(backup)
    else:
        _remove(path)
        shutil.move(backup, path)  # a rename; a copy that keeps mtimes where results/ is another file system
    _state(self)[1].add(str(path))
    return True


async def finished(self, job) -> None:
    """Snakemake's `finished`, then the metadata of each restored output put back as it was before the job."""
    await _FINISHED(self, job)
    kept, restored = _state(self)
    for f in job.output:
        key = str(f)
        record = kept.pop(key, None)
        if key in restored:
            restored.discard(key)
            self._clear_cache()
            if record is None:
                self._delete_record(key)
            else:
                self._write_record(key, record)
    self._clear_cache()


def install() -> None:
    """Make Snakemake's update() backups hard links, its restores renames that also restore the outputs' metadata
    (idempotent)."""
    FileBackupMixin.backup_output = backup_output
    FileBackupMixin.restore_output = restore_output
    PersistenceBase.finished = finished
