"""Small file helpers shared by every stage: atomic writes, hashing, deterministic Parquet.

Every output is written under a temporary name beside its final one and renamed into place only once it is
complete and flushed to disk: `atomic_path` for one file, `atomic_dir` for a directory, `atomic_files` for
all the outputs of a stage at once (nothing is renamed until every one of them is written). So a job that
is killed, or whose write fails (disk full, permission denied), never leaves a file that looks complete
and never damages the previous version of its outputs; the error names the output and the cause. Snakemake
adds its own guard on top: outputs of a job that did not finish are marked incomplete and rerun.

Temporaries are named `.<name>.<random>.tmp` (`.old` for a directory moved aside while it is replaced).
A job owns its outputs (Snakemake never runs two jobs for one output), so a writer removes its target's
temporaries left behind by a killed earlier attempt before it starts.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

_CHUNK = 4 << 20
PAUSE_ENV = "SNAKETUNE_TEST_PAUSE_BEFORE_RENAME"
"""Test hook, used only by tests/test_faults.py: output paths (globs, relative to the working directory,
separated by `:`). A writer whose target matches logs `test hook ...: paused` to stderr (the job's log)
just before it renames the finished temporary into place, and sleeps until it is killed, so that a test
can SIGKILL a job at that exact point. Unset, as everywhere outside that test, it does nothing."""
_CAUSES = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "the file is larger than the file size limit (ulimit -f)",
}
# Errors raised by libraries that write through their own code (pyarrow, tokenizers) carry the errno only
# in their message: "[errno 28] No space left on device", "No space left on device (os error 28)".
_ERRNO_IN_TEXT = re.compile(r"(?:errno|os error)\s*(\d+)", re.IGNORECASE)


def sha256_file(path: str | os.PathLike) -> str:
    # Read into one reused 4 MiB buffer: ~1.4 GB/s on this project's CPU machine, where hashlib.file_digest's 256 KiB
    # reads gave 0.3 GB/s (a 2 GiB file, 2026-12-07).
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hash_files(paths: list[str | os.PathLike], threads: int | None = None) -> dict[str, str]:
    """sha256 of each file (keyed as given), `threads` files at a time (default: one per CPU), largest first.
    hashlib releases the GIL while it hashes, so files hash in parallel on threads; one file is one stream
    (sha256 is sequential), so a 14 GB file takes what one core hashes (bench/RESULTS.md, "Verify")."""
    keys = list(dict.fromkeys(paths))
    if not keys:
        return {}
    keys.sort(key=lambda p: os.stat(p).st_size, reverse=True)
    workers = max(1, min(len(keys), threads or os.cpu_count() or 1))
    if workers == 1:
        return {k: sha256_file(k) for k in keys}
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(keys, pool.map(sha256_file, keys), strict=True))


def sha256_tree(root: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file under root, keyed by relative POSIX path, sorted."""
    root = Path(root)
    if root.is_file():
        return {root.name: sha256_file(root)}
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stable_json(obj: Any) -> str:
    """JSON with sorted keys: the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- temporaries ---------------------------------------------------------------------------------


def _is_temporary_of(name: str, entry: str) -> bool:
    return re.fullmatch(rf"\.{re.escape(name)}\.[^.]+\.(?:tmp|old)", entry) is not None


def _is_temporary(entry: str) -> bool:
    return re.fullmatch(r"\..+\.[^.]+\.(?:tmp|old)", entry) is not None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporaries of `path` that a killed earlier writer left beside it; returns them."""
    path = Path(path)
    try:
        entries = sorted(path.parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    stale = [e for e in entries if _is_temporary_of(path.name, e.name)]
    for entry in stale:
        _remove(entry)
    return stale


def fsync_tree(path: Path) -> None:
    """Flush a written file, or every file of a tree, to disk before it is renamed into place: a write error
    the kernel reports late (NFS, quotas) surfaces here, and a crash of the machine cannot leave a renamed
    but empty file."""
    files = [path] if not path.is_dir() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: some file systems refuse fsync on directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pause_for_tests(staged: Path, target: Path) -> None:
    patterns = os.environ.get(PAUSE_ENV)
    if not patterns:
        return
    rel = os.path.relpath(target)
    if any(fnmatch.fnmatchcase(rel, p) for p in patterns.split(os.pathsep) if p):
        print(
            f"test hook {PAUSE_ENV}: paused before renaming {staged} onto {rel}", file=sys.stderr, flush=True
        )
        while True:
            time.sleep(3600)


def _commit(staged: Path, target: Path, *, sync: bool = True) -> None:
    """Rename a finished temporary onto its target. A directory cannot be renamed over a non-empty one, so
    an existing target directory is moved aside first and put back if the second rename fails."""
    if sync:
        fsync_tree(staged)
    _pause_for_tests(staged, target)
    if target.exists() and (target.is_dir() or staged.is_dir()):
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        aside.rmdir()  # only its unique name is needed
        os.replace(target, aside)
        try:
            os.replace(staged, target)
        except BaseException:
            os.replace(aside, target)
            raise
        _remove(aside)
    else:
        os.replace(staged, target)
    _fsync_dir(target.parent)


# ---- errors --------------------------------------------------------------------------------------


def _errno(e: BaseException | None) -> int | None:
    """The errno behind an error, from it or the errors it was raised from."""
    for _ in range(8):  # chained errors can form a cycle
        if e is None:
            return None
        if isinstance(getattr(e, "errno", None), int):
            return e.errno
        m = _ERRNO_IN_TEXT.search(str(e))
        if m:
            return int(m.group(1))
        e = e.__cause__ or e.__context__
    return None


def _names(targets: list[Path]) -> str:
    """`a/b/x.json`, or `a/b/{x.json, y.json}` for several outputs of one directory."""
    if len(targets) == 1:
        return str(targets[0])
    parents = {t.parent for t in targets}
    if len(parents) == 1:
        return f"{parents.pop()}/{{{', '.join(t.name for t in targets)}}}"
    return ", ".join(map(str, targets))


@contextmanager
def _explained(targets: list[Path]) -> Iterator[None]:
    """Add to any error raised while writing `targets` a note naming them, the cause when it is a known
    errno, and that the previous versions are unchanged (the writers only ever touch temporaries before
    the final renames). A write into another writer's temporary adds none: that writer names the output."""
    if any(_is_temporary(part) for t in targets for part in t.parts[:-1]):
        yield
        return
    existed = [t for t in targets if t.exists()]
    try:
        yield
    except Exception as e:
        cause = _CAUSES.get(_errno(e))
        if not existed:
            kept = "nothing was written there"
        elif len(existed) == len(targets):
            kept = (
                "its previous version is unchanged"
                if len(targets) == 1
                else "their previous versions are unchanged"
            )
        else:
            kept = f"the previous versions of {_names(existed)} are unchanged"
        e.add_note(f"writing {_names(targets)} failed{f' ({cause})' if cause else ''}; {kept}")
        raise


# ---- atomic writers ------------------------------------------------------------------------------


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` only on success."""
    path = Path(path)
    with _explained([path]):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
            yield tmp
            _commit(tmp, path)
        finally:
            _remove(tmp)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it replaces `path` only on success."""
    path = Path(path)
    with _explained([path]):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
            yield tmp
            _commit(tmp, path)
        finally:
            _remove(tmp)


@contextmanager
def atomic_files(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """All-or-nothing outputs of one stage: yield, for each of `paths` (files or directories), a path of the
    same name in a staging directory beside it; when the block succeeds each staged entry is renamed onto
    its target. Until then no target changes, and the final renames need neither space nor permissions
    beyond what creating the staging directory took. Entries the block leaves in a staging directory that
    are not among `paths` are an error (an undeclared output would be lost)."""
    targets = [Path(p) for p in paths]
    if len({t.resolve() for t in targets}) != len(targets):
        raise ValueError(f"atomic_files: a path is given twice: {[str(t) for t in targets]}")
    with _explained(targets):
        staging: dict[Path, Path] = {}
        try:
            for t in targets:
                t.parent.mkdir(parents=True, exist_ok=True)
                remove_stale_temporaries(t)
            for t in targets:
                if t.parent not in staging:
                    # Named after its first target, so that the cleanup above finds it after a kill.
                    d = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent))
                    os.chmod(d, 0o777 & ~_umask())
                    staging[t.parent] = d
            staged = [staging[t.parent] / t.name for t in targets]
            yield staged
            missing = [str(t) for t, s in zip(targets, staged, strict=True) if not s.exists()]
            if missing:
                raise FileNotFoundError(f"the stage did not write {', '.join(missing)}")
            extra = [str(e) for d in staging.values() for e in sorted(d.iterdir()) if e not in staged]
            if extra:
                raise ValueError(f"the stage wrote undeclared outputs: {', '.join(extra)}")
            for s in staged:  # every write error before the first rename
                fsync_tree(s)
            for t, s in zip(targets, staged, strict=True):
                _commit(s, t, sync=False)
        finally:
            for d in staging.values():
                _remove(d)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(stable_json(obj), encoding="utf-8")


def write_parquet(table: pa.Table, path: str | os.PathLike) -> None:
    """Parquet with fixed writer options so that equal tables give equal bytes."""
    # Imported here: keys imports this module whenever Snakemake builds the DAG, where pyarrow (and numpy)
    # would cost ~0.3 s per command.
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(
            table,
            tmp,
            compression="zstd",
            compression_level=3,
            use_dictionary=True,
            write_statistics=True,
            # The default `created_by` carries only the pyarrow version: stable for a pinned env.
        )


def write_sha256sums(directory: str | os.PathLike, names: list[str], out_name: str = "SHA256SUMS") -> dict:
    """`sha256sum -c`-compatible checksum file for the named files in `directory`."""
    directory = Path(directory)
    sums = {name: sha256_file(directory / name) for name in sorted(names)}
    with atomic_path(directory / out_name) as tmp:
        tmp.write_text("".join(f"{h}  {n}\n" for n, h in sums.items()), encoding="utf-8")
    return sums
