"""Small file helpers shared by every stage: atomic writes, hashing, deterministic Parquet.

Every output is written to a temporary path beside its final name and renamed into place, so a killed
job never leaves a file that looks complete (Snakemake also marks such outputs incomplete).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it replaces `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
