"""JSON Lines files as every reader of a local dataset file takes them (oasst messages, chat-format conversations,
preference pairs): `.jsonl` or `.jsonl.gz`, one JSON object per non-blank line, UTF-8 (a byte order mark on the first
line allowed). A malformed line, a key twice in one object or invalid UTF-8 is a DataError naming the file, the line
and what is allowed. Light on purpose (no pandas, numpy or pyarrow): snaketune.data.formats reads a file's first line
here when Snakemake builds the DAG.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """The input data is wrong; the message names the file, the field, the row and what is allowed."""


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                # json.loads would keep the last value silently; which one the author meant is a guess.
                raise ValueError(f"key {key!r} appears twice in one object")
            seen.add(key)
    return record


def json_lines(path: Path, what: str = "one message or one tree"):
    """(line number, JSON object) of every non-blank line of a .jsonl or .jsonl.gz file; `what` says in errors what
    a line holds."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                try:
                    # utf-8-sig on the first line: editors on Windows often start a file with a BOM.
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}: line {line_no}: invalid UTF-8 at byte {e.start} of the line; "
                        "allowed: UTF-8 text"
                    ) from e
                if not line.strip():
                    continue
                try:
                    # Without the line end: an unclosed string would otherwise end in "invalid control character".
                    record = json.loads(line.rstrip("\r\n"), object_pairs_hook=_object_without_duplicate_keys)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}: line {line_no}: malformed JSON at column {e.colno} ({e.msg}); "
                        "allowed: one JSON object per line"
                    ) from e
                except ValueError as e:  # from the duplicate-key hook
                    raise DataError(f"{path}: line {line_no}: {e}; allowed: each key once per object") from e
                if not isinstance(record, dict):
                    raise DataError(
                        f"{path}: line {line_no}: expected a JSON object ({what}), "
                        f"got {type(record).__name__}; allowed: one JSON object per line"
                    )
                yield line_no, record
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(
            f"{path}: not a readable gzip file ({e}); allowed: a .jsonl.gz written by gzip"
        ) from e


def is_tree_record(record: dict) -> bool:
    """A line of LAION's nested export (`*.trees.jsonl`): a tree with its root message under `prompt`."""
    return "prompt" in record and "role" not in record
